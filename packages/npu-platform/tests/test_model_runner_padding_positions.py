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


def _roberta_steps(
    monkeypatch: pytest.MonkeyPatch, runner, steps: list[tuple[int, int]], *, release: str = "0.11.0"
) -> torch.Tensor:
    """Run ``_preprocess`` for each (scheduled, padded) token count, as vLLM fills the scheduled positions
    (0..n-1), then RoBERTa's in-place ``+= padding_idx + 1`` (padding_idx 1) on the padded slice. ``release``: the
    calling convention of vLLM 0.11.0 (counts returned first) or 0.11.1 (padded count passed in, tensors returned)."""
    from vllm.model_executor.models.roberta import replace_roberta_positions

    step: dict[str, int] = {}

    def vllm_preprocess_0_11_0(self, scheduler_output, *args, **kwargs):
        n, padded = step["n"], step["padded"]
        self.positions.gpu[:n] = torch.arange(n)  # vLLM's copy_to_gpu(total_num_scheduled_tokens)
        return (n, padded, None, None, None, self.positions.gpu[:padded], None, {})

    def vllm_preprocess_0_11_1(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        n = scheduler_output.total_num_scheduled_tokens
        self.positions.gpu[:n] = torch.arange(n)
        return (None, None, self.positions.gpu[:num_input_tokens], None, {}, None)

    new_convention = release != "0.11.0"
    monkeypatch.setattr(runner_mod, "PREPROCESS_TAKES_NUM_INPUT", new_convention)
    monkeypatch.setattr(
        GPUModelRunner, "_preprocess", vllm_preprocess_0_11_1 if new_convention else vllm_preprocess_0_11_0
    )
    for n, padded in steps:
        step.update(n=n, padded=padded)
        if new_convention:
            out = runner._preprocess(SimpleNamespace(total_num_scheduled_tokens=n), padded)
            positions = out[2]
        else:
            out = runner._preprocess(SimpleNamespace())
            positions = out[5]
        replace_roberta_positions(torch.zeros(padded, dtype=torch.int32), positions, padding_idx=1)
    return runner.positions.gpu


@pytest.mark.parametrize("release", ["0.11.0", "0.11.1"])
def test_padding_positions_stay_in_range(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    runner = _runner(torch.zeros(16, dtype=torch.int64))
    positions = _roberta_steps(monkeypatch, runner, [(3, 4)] * 300, release=release)
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


@pytest.mark.parametrize("release", ["0.11.0", "0.11.1"])
def test_unpadded_and_mrope_steps_are_left_alone(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    runner = _runner(torch.full((8,), 7, dtype=torch.int64))
    positions = _roberta_steps(monkeypatch, runner, [(4, 4)], release=release)
    assert positions.tolist() == [2, 3, 4, 5, 7, 7, 7, 7]
    mrope = _runner(torch.full((8,), 7, dtype=torch.int64), mrope=True)
    assert _roberta_steps(monkeypatch, mrope, [(2, 4)], release=release)[:4].tolist() == [2, 3, 9, 9]


def test_the_calling_convention_is_read_off_the_installed_vllm() -> None:
    import inspect

    takes = "num_input_tokens" in inspect.signature(GPUModelRunner._preprocess).parameters
    assert runner_mod.PREPROCESS_TAKES_NUM_INPUT is takes
