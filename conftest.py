# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Root pytest configuration, loaded before any test module of the workspace (and in every xdist worker).

The suite runs with ``-n 2`` on a 2-core machine and its vLLM engines start further processes. torch's OpenMP pool
defaults to one thread per core in every one of them, and oversubscribed OpenMP barriers spin: a CPU step then runs
tens of times slower. One intra-op thread per process keeps the whole suite within the machine. Set before torch is
imported anywhere; child processes inherit it. An explicit setting of the caller wins.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The suite exercises the emulated device. vLLM resolves its platform once per process, on first use, and an xdist
# worker runs many modules: whichever touches vLLM first would otherwise fix the platform (to UnspecifiedPlatform on
# this CPU host) for all the others. Tests of other VLLM_NPU_DEVICE values set it explicitly (monkeypatch +
# reset_device_selection for the pure decision logic, a subprocess for vLLM's own platform resolution).
os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")


@pytest.fixture(autouse=True, scope="session")
def _vllm_platform_resolved_emulated() -> None:
    """Resolve vLLM's platform once per process while VLLM_NPU_DEVICE is still "emulated".

    Tests that clear VLLM_NPU_DEVICE (the interface's clean-environment fixture, the device-decision tests) may touch
    ``vllm.platforms.current_platform`` through some vLLM import; resolved there, it would be UnspecifiedPlatform for the
    rest of the xdist worker, and every later module that builds a VllmConfig would fail with "Failed to infer device
    type" depending on which files the worker happened to get first.
    """
    if os.environ.get("VLLM_NPU_DEVICE") != "emulated":
        return
    from vllm.platforms import current_platform

    assert current_platform.device_type, (
        f"vLLM resolved {type(current_platform).__name__} under VLLM_NPU_DEVICE=emulated"
    )


def pytest_report_header() -> str | None:
    """Say up front when the Mooncake engine's system libraries are missing (its tests then fail with this line)."""
    from npu_testkit.system_libs import missing_message

    text = missing_message()
    return f"WARNING: {text}" if text else None


#: Markers of the modules that take half a minute or more (real engines, wheel builds, mypy and the like).
_LONG_MARKERS = ("engine", "selective_install", "long")


def pytest_configure(config: pytest.Config) -> None:
    """Keep the collection order under ``--dist loadfile``: pytest-xdist (3.x) otherwise re-sorts the modules by their
    number of tests, most first, which put the one-test end-to-end modules (the longest) last."""
    if hasattr(config.option, "loadscopereorder"):  # only when xdist is loaded
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long modules first, the many short ones after them (stable: each module's tests keep their order).

    ``-n 2 --dist loadfile`` hands whole modules to the workers in collection order; in path order the end-to-end
    modules come last, so one long module (the e2e selftest, ~2 min) used to run while the other worker was already
    done. Short modules at the end fill the gap: the longest-first rule of scheduling on two machines."""
    items.sort(key=lambda item: 0 if any(item.get_closest_marker(m) for m in _LONG_MARKERS) else 1)
