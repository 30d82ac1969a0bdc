# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.platform: the Ascend NPU platform for vLLM.

``register`` is vLLM's ``vllm.platform_plugins`` hook (entry point ``npu``). vLLM calls it in every process, twice,
and silently swallows anything it raises, so it imports nothing heavy (no torch, no torch_npu, no vLLM), never
raises, and logs why it declines. A bad ``VLLM_NPU_*`` value (unless ``VLLM_NPU_DEVICE=off``) is the exception to
declining: the platform then activates so that its ``__init__`` raises our ConfigError before vLLM fails on
anything else. Where it activates, it also makes vLLM's engine processes exit with their parent
(:mod:`.parent_watch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

PLATFORM_CLASSES = {
    "npu": "vllm_npu.platform.platform.NPUPlatform",
    "emulated": "vllm_npu.platform.platform.EmulatedNPUPlatform",
}

_declined_reasons: set[str] = set()  # log each distinct decline reason once per process


def register() -> str | None:
    """Return the platform class path if this process should run on the NPU platform, else None."""
    from vllm_npu.interface import ConfigError, current_device, get_logger

    logger = get_logger(__name__)
    try:
        decision = current_device()
    except ConfigError as exc:
        # A bad VLLM_NPU_DEVICE: declining would leave vLLM to fail on something unrelated ("Failed to infer device
        # type"). Activate instead; the platform's __init__ raises this ConfigError.
        logger.warning("NPU platform activated only to report a bad environment: %s", exc)
        return PLATFORM_CLASSES["npu"]
    except Exception as exc:  # vLLM would swallow it silently; say it instead
        logger.warning("NPU platform not activated: %s", exc)
        return None
    if decision.mode is None and decision.requested != "off" and (problem := _environment_problem()) is not None:
        # Same for any other bad VLLM_NPU_* value when the platform would decline (auto on a host without an NPU).
        logger.warning("NPU platform activated only to report a bad environment: %s", problem)
        return PLATFORM_CLASSES["npu"]
    if decision.mode is None:
        if decision.reason not in _declined_reasons:
            _declined_reasons.add(decision.reason)
            logger.info("NPU platform not activated: %s", decision.reason)
        return None
    # vLLM's engine processes (engine core, workers) exit when their parent dies instead of holding the device.
    from .parent_watch import install

    install()
    return PLATFORM_CLASSES[decision.mode.value]


def _environment_problem() -> str | None:
    """The ConfigError text of the process's ``VLLM_NPU_*`` variables, or None. Imports the settings schema
    (pydantic) only when such a variable other than ``VLLM_NPU_DEVICE`` is set, so the usual call stays light."""
    import os

    if not any(k.startswith("VLLM_NPU_") and k != "VLLM_NPU_DEVICE" for k in os.environ):
        return None
    from vllm_npu.interface import ConfigError, EnvConfig

    try:
        EnvConfig.from_environ()
    except ConfigError as exc:
        return str(exc)
    return None


# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS = {
    "NPUPlatform": ".platform:NPUPlatform",
    "EmulatedNPUPlatform": ".platform:EmulatedNPUPlatform",
    "selftest_cases": ".sample.selftest:selftest_cases",
}

if TYPE_CHECKING:
    from .platform import EmulatedNPUPlatform, NPUPlatform
    from .sample.selftest import selftest_cases
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "PLATFORM_CLASSES",
    "EmulatedNPUPlatform",
    "NPUPlatform",
    "__version__",
    "register",
    "selftest_cases",
]
