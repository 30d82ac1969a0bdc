# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUModelRunner.profile_run: vLLM's full-size run on an NPU; on the emulated device an engine-shaped one (every
request slot, at least EMULATED_PROFILE_MIN_TOKENS tokens) without the full garbage collection."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm_npu.platform import model_runner as runner_mod
from vllm_npu.platform._device import EmulatedDevice


def _runner(backend: object, *, max_tokens: int = 8192, max_reqs: int = 16, mm: bool = False):
    r = object.__new__(runner_mod.NPUModelRunner)
    r.device_backend = backend
    r.device = "cpu"
    r.max_num_tokens, r.max_num_reqs = max_tokens, max_reqs
    r.supports_mm_inputs, r.is_pooling_model = mm, False
    calls: list[tuple[str, int]] = []
    r._dummy_run = lambda n, is_profile=False: (calls.append(("forward", n)), ("h", "last"))[1]
    r._dummy_sampler_run = lambda last: calls.append(("sampler", 0))
    return r, calls


@pytest.fixture
def no_gc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_mod, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True))
    monkeypatch.setattr(gc, "collect", lambda *a: pytest.fail("full collection in the emulated profile run"))


@pytest.mark.parametrize(
    "max_tokens,max_reqs,expect",
    [(8192, 16, runner_mod.EMULATED_PROFILE_MIN_TOKENS), (8192, 1024, 1024), (128, 16, 128), (2048, 256, 256)],
)
def test_emulated_profile_run_is_engine_shaped(no_gc, max_tokens: int, max_reqs: int, expect: int) -> None:
    r, calls = _runner(EmulatedDevice, max_tokens=max_tokens, max_reqs=max_reqs)
    r.profile_run()
    assert calls == [("forward", expect), ("sampler", 0)]


@pytest.mark.parametrize("backend,mm", [(SimpleNamespace(type="npu"), False), (EmulatedDevice, True)])
def test_npu_and_multimodal_keep_vllms_profile_run(monkeypatch: pytest.MonkeyPatch, backend: object, mm: bool) -> None:
    seen: list[str] = []
    monkeypatch.setattr(GPUModelRunner, "profile_run", lambda self: seen.append("vllm"))
    r, calls = _runner(backend, mm=mm)
    r.profile_run()
    assert seen == ["vllm"] and calls == []
