# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUModelRunner._preprocess zeroes the positions of a step's graph padding (as vllm-ascend's runner does), so a
model that adds to its positions in place (RoBERTa's ``replace_roberta_positions``) cannot grow the stale padding
slots step after step (vllm#37868). The end-to-end case: tests/e2e/test_pooling_xlmr_embed.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm_npu.platform import model_runner as runner_mod


def _runner(positions: torch.Tensor, *, mrope: bool = False):
    r = object.__new__(runner_mod.NPUModelRunner)
    r.positions = SimpleNamespace(gpu=positions)
    r.uses_mrope = mrope
    return r


def _roberta_steps(monkeypatch: pytest.MonkeyPatch, runner, steps: list[tuple[int, int]]) -> torch.Tensor:
    """Run ``_preprocess`` for each (scheduled, padded) token count, as vLLM fills the scheduled positions
    (0..n-1), then RoBERTa's in-place ``+= padding_idx + 1`` (padding_idx 1) on the padded slice."""
    from vllm.model_executor.models.roberta import replace_roberta_positions

    step: dict[str, int] = {}

    def vllm_preprocess(self, scheduler_output, *args, **kwargs):
        n, padded = step["n"], step["padded"]
        self.positions.gpu[:n] = torch.arange(n)  # vLLM's copy_to_gpu(total_num_scheduled_tokens)
        return (n, padded, None, None, None, self.positions.gpu[:padded], None, {})

    monkeypatch.setattr(GPUModelRunner, "_preprocess", vllm_preprocess)
    for n, padded in steps:
        step.update(n=n, padded=padded)
        out = runner._preprocess(SimpleNamespace())
        replace_roberta_positions(torch.zeros(padded, dtype=torch.int32), out[5], padding_idx=1)
    return runner.positions.gpu


def test_padding_positions_stay_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner(torch.zeros(16, dtype=torch.int64))
    positions = _roberta_steps(monkeypatch, runner, [(3, 4)] * 300)
    # the last step: real tokens at 2, 3, 4 (RoBERTa's offset), the padding slot at 0 + 2, not 2 * 300
    assert positions[:4].tolist() == [2, 3, 4, 2]


def test_without_the_zeroing_the_padding_slot_grows_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # What vLLM's own runner does (the guard that the test above is live): the slot grows by 2 per step.
    runner = _runner(torch.zeros(16, dtype=torch.int64))
    monkeypatch.setattr(
        runner_mod.NPUModelRunner, "_preprocess", lambda self, *a, **k: GPUModelRunner._preprocess(self, *a, **k)
    )
    positions = _roberta_steps(monkeypatch, runner, [(3, 4)] * 300)
    assert positions[3].item() == 2 * 300


def test_unpadded_and_mrope_steps_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner(torch.full((8,), 7, dtype=torch.int64))
    positions = _roberta_steps(monkeypatch, runner, [(4, 4)])
    assert positions.tolist() == [2, 3, 4, 5, 7, 7, 7, 7]
    mrope = _runner(torch.full((8,), 7, dtype=torch.int64), mrope=True)
    assert _roberta_steps(monkeypatch, mrope, [(2, 4)])[:4].tolist() == [2, 3, 9, 9]
