# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""torch_npu's runtime rules on both devices: no device runtime in the front-end, spawn by default, the fork rule,
and the stand-in torch_npu that keeps the same rule for the NPU path."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
from npu_testkit.npu_runtime_standin import install_for_test
from vllm_npu.platform import _device
from vllm_npu.platform._device import EMULATED_RUNTIME, FORK_ERROR, EmulatedDevice, NPUDevice

pytestmark = pytest.mark.long  # half a minute or more: scheduled with the engine modules (conftest.py)


def _child_set_device(backend: type, queue: multiprocessing.Queue) -> None:
    try:
        backend.empty_cache()  # not an initialising call: never raises
        backend.set_device(torch.device("cpu"))
        queue.put("ok")
    except RuntimeError as e:
        queue.put(f"RuntimeError: {e}")


def _fork_child_result(backend: type) -> str:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_set_device, args=(backend, queue))
    proc.start()
    try:
        return queue.get(timeout=60)
    finally:
        proc.join(60)


def test_emulated_device_fork_after_init_raises_in_the_child():
    EmulatedDevice.mem_get_info()  # torch_npu runs _lazy_init here (npu/__init__.py:463)
    assert EmulatedDevice.runtime_initialized()
    result = _fork_child_result(EmulatedDevice)
    assert result.startswith("RuntimeError: " + FORK_ERROR), result
    assert "first runtime call in this process: set_device" in result
    assert EMULATED_RUNTIME.initialized  # the parent is unaffected


def test_emulated_device_calls_that_do_not_initialise_in_torch_npu_do_not_here():
    state = _device.DeviceRuntimeState()
    real = _device.EMULATED_RUNTIME
    _device.EMULATED_RUNTIME = state
    try:
        EmulatedDevice.empty_cache()
        EmulatedDevice.memory_allocated()
        EmulatedDevice.peak_memory_allocated()
        EmulatedDevice.device_name()
        EmulatedDevice.stream_api()["Stream"]()  # no device: torch_npu's device(None) context does not initialise
        assert not state.initialized
        EmulatedDevice.stream_api()["current_stream"]()
        assert state.initialized and state.calls[-1] == "current_stream"
    finally:
        _device.EMULATED_RUNTIME = real


def test_stand_in_torch_npu_keeps_the_fork_rule_for_the_npu_path(monkeypatch):
    standin = install_for_test(monkeypatch)
    _device._torch_npu.cache_clear()
    try:
        assert not NPUDevice.runtime_initialized()
        NPUDevice.device_name()
        NPUDevice.empty_cache()
        assert not NPUDevice.runtime_initialized()  # neither initialises in torch_npu
        NPUDevice.mem_get_info(0)
        assert NPUDevice.runtime_initialized() and standin.state.initialising_calls() == ["mem_get_info"]
        result = _fork_child_result(NPUDevice)
        assert result.startswith("RuntimeError: torch_npu stand-in: cannot re-initialize"), result
    finally:
        _device._torch_npu.cache_clear()


FRONT_END = """
import json, os, sys
from npu_testkit.npu_runtime_standin import install
standin = install() if sys.argv[2] == "npu" else None
import vllm.platforms as platforms
from vllm_npu.platform.platform import EmulatedNPUPlatform, NPUPlatform
platforms._current_platform = (NPUPlatform if sys.argv[2] == "npu" else EmulatedNPUPlatform)()
from vllm.engine.arg_utils import EngineArgs
EngineArgs(model=sys.argv[1], max_model_len=128, enforce_eager=True).create_engine_config()
from vllm_npu.platform._device import EMULATED_RUNTIME
print("RESULT", json.dumps({
    "platform": type(platforms._current_platform).__name__,
    "npu_initialised": bool(standin and standin.module.npu.is_initialized()),
    "npu_calls": standin.state.calls if standin else [],
    "emulated_initialised": EMULATED_RUNTIME.initialized,
    "emulated_calls": list(EMULATED_RUNTIME.calls),
    "start_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
}))
"""


@pytest.fixture(scope="module")
def tiny_model():
    from npu_testkit.engine import tiny_config
    from npu_testkit.models import build_tiny_model

    return build_tiny_model(tiny_config("qwen2"))


@pytest.mark.parametrize("device", ["npu", "emulated"])
def test_building_the_engine_config_in_the_front_end_leaves_the_runtime_alone(tiny_model, device):
    """vLLM's EngineArgs.create_engine_config (the front-end process of `LLM` and `vllm serve`) calls the
    platform's hooks; none may initialise the device runtime there (the engine core and workers fork from it)."""
    import json

    from npu_testkit.engine import patched_environ, shared_vllm_cache_root
    from npu_testkit.model_info import warm_model_info

    env = {**os.environ, "VLLM_NPU_DEVICE": "emulated", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    # vLLM's model-class inspection found cached, as the engines' front ends find it (its subprocess is another
    # process: nothing this test watches; it only cost 10-20 s per case)
    env["VLLM_CACHE_ROOT"] = str(shared_vllm_cache_root())
    with patched_environ({"VLLM_CACHE_ROOT": env["VLLM_CACHE_ROOT"]}):
        warm_model_info(tiny_model)
    proc = subprocess.run(
        [sys.executable, "-c", FRONT_END, str(tiny_model), device],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["platform"] == ("NPUPlatform" if device == "npu" else "EmulatedNPUPlatform")
    assert (result["npu_initialised"], result["npu_calls"]) == (False, [])  # not one torch.npu call
    assert (result["emulated_initialised"], result["emulated_calls"]) == (False, [])
    assert result["start_method"] == "spawn"  # vLLM would fork the engine core: the platform defaults to spawn


def test_get_device_total_memory_is_not_answered_on_either_device():
    from vllm_npu.platform.platform import EmulatedNPUPlatform, NPUPlatform

    for cls in (NPUPlatform, EmulatedNPUPlatform):
        with pytest.raises(NotImplementedError):
            cls.get_device_total_memory()


# --- the config hook: start method and --enable-dbo --------------------------------------------------------------


def _fake_config(**parallel):
    from npu_testkit.sibling import import_sibling

    cfg = import_sibling(__file__, "test_platform").fake_vllm_config()
    for k, v in parallel.items():
        setattr(cfg.parallel_config, k, v)
    return cfg


@pytest.mark.parametrize("cls_name", ["NPUPlatform", "EmulatedNPUPlatform"])
def test_config_hook_defaults_to_spawn_and_keeps_a_user_choice(monkeypatch, cls_name):
    from vllm_npu.platform import platform as platform_mod

    cls = getattr(platform_mod, cls_name)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    cls.check_and_update_config(_fake_config())
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    cls.check_and_update_config(_fake_config())
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


@pytest.mark.parametrize("cls_name", ["NPUPlatform", "EmulatedNPUPlatform"])
def test_dual_batch_overlap_is_refused_by_name(monkeypatch, cls_name):
    from vllm_npu.interface import ConfigError
    from vllm_npu.platform import platform as platform_mod

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with pytest.raises(
        ConfigError, match=r"--enable-dbo \(dual-batch overlap\) is not supported .*remove --enable-dbo"
    ):
        getattr(platform_mod, cls_name).check_and_update_config(_fake_config(enable_dbo=True))
