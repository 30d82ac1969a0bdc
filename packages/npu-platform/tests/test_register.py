# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ``vllm.platform_plugins`` hook: import-light, pure, never raising, and declining on a CPU host by default."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from npu_testkit.import_light import assert_import_light
from vllm_npu.interface import reset_device_selection
from vllm_npu.platform import PLATFORM_CLASSES, register

_PROBE = textwrap.dedent(
    """
    import json
    import vllm_npu.platform
    first = vllm_npu.platform.register()
    second = vllm_npu.platform.register()  # vLLM calls it twice
    print(json.dumps({"first": first, "second": second}))
    """
)


# What the platform hook must not import on its normal path (a bad VLLM_NPU_* value may load pydantic to report it).
HOOK_HEAVY = ("torch", "torch_npu", "vllm", "pydantic", "packaging", "transformers")


def run_register(forbid: tuple[str, ...] = (), **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_NPU_", "VLLM_PLUGINS"))}
    return json.loads(assert_import_light(_PROBE, forbid=forbid, env={**clean, **env}, timeout=60))


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"VLLM_NPU_DEVICE": "off"}, None),
        ({"VLLM_NPU_DEVICE": "emulated"}, "vllm_npu.platform.platform.EmulatedNPUPlatform"),
        # Asked for the NPU without one: the platform activates so that it can fail loudly at init, not fall back.
        ({"VLLM_NPU_DEVICE": "npu"}, "vllm_npu.platform.platform.NPUPlatform"),
        # A bad value: the platform activates so that its init raises our ConfigError, not vLLM's unrelated error.
        ({"VLLM_NPU_DEVICE": "bogus"}, "vllm_npu.platform.platform.NPUPlatform"),
    ],
)
def test_register_is_import_light_and_pure(env: dict[str, str], expected: str | None) -> None:
    result = run_register(HOOK_HEAVY, **env)
    assert result["first"] == expected and result["second"] == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"VLLM_NPU_PATCHES": "zzz"}, "vllm_npu.platform.platform.NPUPlatform"),
        ({"VLLM_NPU_DEVCE": "emulated"}, "vllm_npu.platform.platform.NPUPlatform"),  # a typo'd name
        ({"VLLM_NPU_EMULATED_KV_CACHE_GB": "lots"}, "vllm_npu.platform.platform.NPUPlatform"),
        ({"VLLM_NPU_PATCHES": "all"}, None),  # a good value: auto declines as before
        ({"VLLM_NPU_DEVICE": "off", "VLLM_NPU_PATCHES": "zzz"}, None),  # off means off
    ],
)
def test_bad_env_value_activates_the_platform_to_report_it(env: dict[str, str], expected: str | None) -> None:
    result = run_register(**env)
    assert result["first"] == expected and result["second"] == expected


def test_register_names_existing_classes() -> None:
    assert set(PLATFORM_CLASSES) == {"npu", "emulated"}
    for path in PLATFORM_CLASSES.values():
        module, _, cls = path.rpartition(".")
        assert module == "vllm_npu.platform.platform" and cls.endswith("NPUPlatform")


def test_register_logs_why_it_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("vllm.vllm_npu.platform")
    handler, old = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    import vllm_npu.platform as platform_pkg

    monkeypatch.setattr(platform_pkg, "_declined_reasons", set())  # each reason is logged once per process
    try:
        monkeypatch.setenv("VLLM_NPU_DEVICE", "bogus")
        reset_device_selection()
        assert register() == PLATFORM_CLASSES["npu"]  # activated to raise the ConfigError in its init
        monkeypatch.setenv("VLLM_NPU_DEVICE", "auto")
        reset_device_selection()
        assert register() is None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
        reset_device_selection()
    messages = [r.getMessage() for r in records]
    bad = "NPU platform activated only to report a bad environment: bad environment: VLLM_NPU_DEVICE='bogus'"
    assert any(m.startswith(bad) for m in messages)
    assert any("NPU platform not activated: VLLM_NPU_DEVICE=auto and" in m for m in messages)
