# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUModelRunner.capture_model on the emulated device, without an engine: a real NPUGraphWrapper around a recording
runnable, vLLM's capture loop (_capture_cudagraphs) and a stand-in _dummy_run that sets vLLM's forward context as
the real one does. Checks that every size runs eagerly before it is captured (first calls of aclnn/ATB ops and HCCL
must not happen inside a capture) and that running out of device streams is reported with its fixes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.compilation.counter import compilation_counter
from vllm.config import CompilationConfig, CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm_npu.interface import active_recorder
from vllm_npu.platform._device import EmulatedDevice
from vllm_npu.platform.graphs.config import configure_graphs
from vllm_npu.platform.graphs.sizes import GraphStreamsExhaustedError
from vllm_npu.platform.graphs.wrapper import NPUGraphWrapper
from vllm_npu.platform.model_runner import NPUModelRunner

pytestmark = pytest.mark.long  # half a minute or more: scheduled with the engine modules (conftest.py)

SIZES = [2, 4]


def _runner(mode: CUDAGraphMode, calls: list[tuple[int, str]], warmups: int) -> NPUModelRunner:
    cfg = VllmConfig(compilation_config=CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=SIZES))
    cfg.compilation_config.cudagraph_num_of_warmups = warmups  # whatever vLLM left, the platform hook decides
    configure_graphs(cfg, "auto", True)

    def model(x: torch.Tensor) -> torch.Tensor:
        # a capture is running on this thread exactly when a task recorder is active (both devices)
        calls.append((int(x.shape[0]), "capture" if active_recorder() is not None else "eager"))
        return x * 2

    wrapper = NPUGraphWrapper(model, cfg, CUDAGraphMode.PIECEWISE if mode == CUDAGraphMode.PIECEWISE else mode.FULL)
    buffer = torch.ones(max(SIZES))

    def dummy_run(num_tokens: int, cudagraph_runtime_mode: CUDAGraphMode, uniform_decode: bool, **_: Any) -> None:
        key = None
        if cudagraph_runtime_mode != CUDAGraphMode.NONE:
            key = BatchDescriptor(num_tokens=num_tokens, uniform_decode=uniform_decode)
        with set_forward_context(None, cfg, cudagraph_runtime_mode=cudagraph_runtime_mode, batch_descriptor=key):
            wrapper(buffer[:num_tokens])

    runner = object.__new__(NPUModelRunner)
    runner.__dict__.update(
        vllm_config=cfg,
        compilation_config=cfg.compilation_config,
        device=torch.device("cpu"),
        device_backend=EmulatedDevice,
        cudagraph_batch_sizes=sorted(cfg.compilation_config.cudagraph_capture_sizes),
        scheduler_config=SimpleNamespace(max_num_seqs=max(SIZES)),
        parallel_config=SimpleNamespace(enable_dbo=False),
        load_config=SimpleNamespace(use_tqdm_on_load=False),
        lora_config=None,
        uniform_decode_query_len=1,
        cudagraph_captured_before=compilation_counter.num_cudagraph_captured,
        initialize_cudagraph_capture=lambda: None,
        maybe_remove_all_loras=lambda lora_config: None,
        _dummy_run=dummy_run,
    )
    return runner


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY])
@pytest.mark.parametrize("warmups", [0, 1])
def test_each_size_runs_eagerly_before_its_capture(mode, warmups):
    calls: list[tuple[int, str]] = []
    _runner(mode, calls, warmups).capture_model()
    # largest first (smaller graphs reuse the pool), each size: one eager forward, then the capture
    assert calls == [(4, "eager"), (4, "capture"), (2, "eager"), (2, "capture")]


@pytest.mark.parametrize(
    ("mode", "text"),
    [
        (CUDAGraphMode.PIECEWISE, "EL0004: rtStreamBeginCapture failed, retCode=0x7020023"),
        (CUDAGraphMode.FULL_DECODE_ONLY, "NPU function error: Stream resources are insufficient."),
    ],
)
def test_running_out_of_streams_names_the_budget_and_the_fixes(monkeypatch, mode, text):
    def exhausted(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(text)

    monkeypatch.setattr(EmulatedDevice, "capture_graph", staticmethod(exhausted))
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    with pytest.raises(GraphStreamsExhaustedError) as err:
        _runner(mode, [], 1).capture_model()
    message = str(err.value)
    assert "ran out of device streams (ACL error 0x7020023" in message and f"{mode.name}" in message
    assert "the stream budget was HCCL_OP_EXPANSION_MODE=unset" in message and "capture sizes" in message
    for fix in ("cudagraph_capture_sizes", "--max-num-seqs", "HCCL_OP_EXPANSION_MODE=AIV", "--enforce-eager"):
        assert fix in message
    assert isinstance(err.value.__cause__, RuntimeError) and text in str(err.value.__cause__)


def test_other_capture_errors_pass_through(monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("something else")

    monkeypatch.setattr(EmulatedDevice, "capture_graph", staticmethod(broken))
    with pytest.raises(RuntimeError, match="^something else$"):
        _runner(CUDAGraphMode.PIECEWISE, [], 1).capture_model()
