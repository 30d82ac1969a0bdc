# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUModelRunner._dummy_run under data parallelism: the model runs at the DP ranks' padded count (vLLM pads only the
counts), with vLLM's one count all-reduce per run, as vllm-ascend's dummy run (worker/model_runner_v1.py:2397-2399).

vLLM 0.11.0's DP dummy batch (``execute_dummy_batch`` -> ``_dummy_run(1, uniform_decode=True)``) of a rank without
requests beside another rank's 20-token prefill handed the model one row against the counts [20, 20]."""

from __future__ import annotations

import inspect

import pytest
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm_npu.platform import model_runner
from vllm_npu.platform.model_runner import NPUModelRunner


@pytest.mark.parametrize(("counts", "rows"), [([20, 20], 20), (None, 1)])
def test_the_dp_dummy_batch_runs_at_the_padded_count(monkeypatch, counts, rows):
    across = None if counts is None else torch.tensor(counts, dtype=torch.int32)
    syncs: list[int] = []

    def get_dp_padding(self, num_tokens):  # vLLM's: one all-reduce of the ranks' counts (none without DP padding)
        syncs.append(num_tokens)
        return (0, None) if across is None else (int(across.max()) - num_tokens, across)

    seen = []

    def vllm_dummy_run(self, num_tokens, cudagraph_runtime_mode=None, uniform_decode=False, **kwargs):
        pad, counts_seen = self.get_dp_padding(num_tokens)  # what vLLM's _dummy_run asks
        seen.append((num_tokens, uniform_decode, pad, counts_seen))
        return "hidden", "last"

    monkeypatch.setattr(model_runner, "DUMMY_RUN_PADS_ONLY_DP_COUNTS", True)  # vLLM 0.11.0's _dummy_run (faked)
    monkeypatch.setattr(GPUModelRunner, "get_dp_padding", get_dp_padding, raising=False)
    monkeypatch.setattr(GPUModelRunner, "_dummy_run", vllm_dummy_run)
    runner = object.__new__(NPUModelRunner)
    runner.eplb_state = None
    assert runner._dummy_run(1, uniform_decode=True) == ("hidden", "last")
    assert seen == [(rows, True, 0, across)]
    assert syncs == [1]  # one count exchange per dummy run: the ranks' collectives pair one to one
    assert runner._dp_counts_taken is None  # vLLM's exchange again after the run


def test_from_vllm_0_11_1_the_dummy_run_is_vllms(monkeypatch):
    """vLLM 0.11.1 runs the dummy run at the padded count itself (``coordinate_batch_across_dp``; no
    ``get_dp_padding``): the override passes ``num_tokens`` through and exchanges nothing."""
    # the flag follows the installed vLLM: set exactly when its _dummy_run takes the counts through get_dp_padding
    uses = "self.get_dp_padding(" in inspect.getsource(GPUModelRunner._dummy_run)
    assert uses is model_runner.DUMMY_RUN_PADS_ONLY_DP_COUNTS
    monkeypatch.setattr(model_runner, "DUMMY_RUN_PADS_ONLY_DP_COUNTS", False)
    monkeypatch.setattr(
        GPUModelRunner, "get_dp_padding", lambda self, n: pytest.fail("counts exchanged"), raising=False
    )
    seen: list[int] = []
    monkeypatch.setattr(GPUModelRunner, "_dummy_run", lambda self, n, **kwargs: seen.append(n) or ("h", "last"))
    runner = object.__new__(NPUModelRunner)
    runner.eplb_state = None
    assert runner._dummy_run(1, uniform_decode=True) == ("h", "last")
    assert seen == [1]
