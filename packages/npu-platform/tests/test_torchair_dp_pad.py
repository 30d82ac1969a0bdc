# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The torchair draft's passes under data parallelism (:mod:`vllm_npu.platform.graphs.dp_pad`): every DP rank runs
a draft pass at the largest rank's size (the MoE exchange's static shapes), and a rank without requests runs as many
draft passes per step as the ranks with requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.forward_context import DPMetadata
from vllm_npu.platform.graphs import dp_pad


def _context(counts: list[int] | None) -> SimpleNamespace:
    meta = None
    if counts is not None:
        n = torch.tensor(counts, dtype=torch.int32)
        meta = DPMetadata(max_tokens_across_dp_cpu=n.max(), num_tokens_across_dp_cpu=n)
    return SimpleNamespace(dp_metadata=meta, attn_metadata=None, cudagraph_runtime_mode=None, batch_descriptor=None)


@pytest.fixture
def context(monkeypatch):
    """Set the forward context the draft pass reads: ``context([8, 2])`` (the ranks' counts) or ``context(None)``."""
    import vllm.forward_context

    def make(counts: list[int] | None) -> SimpleNamespace:
        ctx = _context(counts)
        monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ctx)
        return ctx

    return make


def _kwargs(n: int, hidden: int = 3) -> dict[str, torch.Tensor | None]:
    return {
        "input_ids": torch.arange(1, n + 1),
        "positions": torch.arange(10, 10 + n),
        "hidden_states": torch.ones(n, hidden),
        "inputs_embeds": None,
    }


def test_a_smaller_rank_pads_its_pass_to_the_largest_and_sees_uniform_counts(context):
    ctx = context([8, 2])
    meta = ctx.dp_metadata
    with dp_pad.dp_padded_pass(_kwargs(2), 2) as (kwargs, size):
        assert size == 8
        assert kwargs["input_ids"].tolist() == [1, 2] + [0] * 6
        assert kwargs["positions"].tolist() == [10, 11] + [0] * 6
        assert kwargs["hidden_states"].shape == (8, 3) and kwargs["hidden_states"][2:].abs().sum() == 0
        assert kwargs["inputs_embeds"] is None
        assert ctx.dp_metadata.num_tokens_across_dp_cpu.tolist() == [8, 8]
        assert int(ctx.dp_metadata.max_tokens_across_dp_cpu) == 8
    assert ctx.dp_metadata is meta  # restored after the pass


def test_the_largest_rank_keeps_its_rows_but_sees_uniform_counts(context):
    ctx = context([8, 2])
    given = _kwargs(8)
    with dp_pad.dp_padded_pass(given, 8) as (kwargs, size):
        assert size == 8 and all(kwargs[k] is given[k] for k in given)
        assert ctx.dp_metadata.num_tokens_across_dp_cpu.tolist() == [8, 8]
    assert ctx.dp_metadata.num_tokens_across_dp_cpu.tolist() == [8, 2]


@pytest.mark.parametrize("counts", [None, [4, 4]], ids=["no-dp", "agreeing"])
def test_a_pass_whose_ranks_agree_is_unchanged(context, counts):
    ctx = context(counts)
    meta, given = ctx.dp_metadata, _kwargs(4)
    with dp_pad.dp_padded_pass(given, 4) as (kwargs, size):
        assert (kwargs, size) == (given, 4) and ctx.dp_metadata is meta


def test_unpad_rows_cuts_tensors_and_tuples():
    out = dp_pad.unpad_rows((torch.zeros(8, 2), torch.ones(8, 2)), 3)
    assert [t.shape for t in out] == [(3, 2), (3, 2)]
    assert dp_pad.unpad_rows(torch.zeros(8), 5).shape == (5,)


class _Recorder(torch.nn.Module):
    """A draft model that records the rows it was given and the DP counts the MoE exchange would read."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, list[int]]] = []

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        import vllm.forward_context

        meta = vllm.forward_context.get_forward_context().dp_metadata
        counts = None if meta is None else meta.num_tokens_across_dp_cpu.tolist()
        self.seen.append((int(input_ids.shape[0]), counts))
        return hidden_states * 2


def test_the_draft_wrapper_runs_a_smaller_ranks_pass_at_the_largest_size(context, monkeypatch):
    """vLLM's proposer pads a draft pass to a capture size of this rank's batch only (2 rows here while the other
    rank runs 8): the wrapper hands the model 8 rows with counts [8, 8] and returns this rank's 2."""
    from vllm_npu.platform.graphs import torchair

    ctx = context([8, 2])
    monkeypatch.setattr(torchair, "get_forward_context", lambda: ctx)
    wrapper = object.__new__(torchair.DraftTorchairWrapper)
    wrapper.runnable = model = _Recorder()
    wrapper.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_capture_sizes=[]))
    out = wrapper(**_kwargs(2))
    assert model.seen == [(8, [8, 8])]
    assert out.shape == (2, 3) and torch.equal(out, torch.full((2, 3), 2.0))


def test_dummy_runs_every_pass_runs_k_passes():
    calls: list[int] = []
    dp_pad.dummy_runs_every_pass(calls.append, 3)(5)
    assert calls == [5, 5, 5]


@pytest.mark.parametrize(("dp", "k", "passes"), [(2, 3, 3), (2, 1, 1), (1, 3, 1)])
def test_the_model_runner_gives_the_drafts_dummy_run_k_passes_under_dp(monkeypatch, dp, k, passes):
    """A DP rank without requests runs vLLM's one-pass ``dummy_run`` while the others run k passes: with k > 1
    their collectives would pair up wrongly. The runner makes it k passes under data parallelism."""
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm_npu.platform import model_runner

    monkeypatch.setattr(model_runner, "torchair_enabled", lambda cfg: True)
    monkeypatch.setattr(model_runner, "DraftTorchairWrapper", lambda model, cfg: model)
    drafter = object.__new__(EagleProposer)
    calls: list[int] = []
    drafter.model, drafter.dummy_run = torch.nn.Identity(), calls.append
    spec = SimpleNamespace(method="deepseek_mtp", num_speculative_tokens=k)
    runner = SimpleNamespace(
        drafter=drafter,
        vllm_config=SimpleNamespace(speculative_config=spec),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[2, 4]),
        parallel_config=SimpleNamespace(data_parallel_size=dp),
    )
    model_runner.NPUModelRunner._compile_draft(runner)
    drafter.dummy_run(1)
    assert calls == [1] * passes


def test_a_dummy_batch_runs_eagerly_at_the_padded_size_of_its_descriptor(monkeypatch):
    """vLLM's DP dummy batch: one row, no attention metadata, runtime mode FULL with the DP-padded size 4 in its
    descriptor. Compiled at size 4 with one row it would recompile (a Dynamo guard on the input's shape); it runs
    eagerly with 4 rows (the other ranks' MoE exchange size) and returns its one."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor
    from vllm_npu.platform.graphs import torchair

    ctx = _context([4, 4])
    ctx.cudagraph_runtime_mode, ctx.batch_descriptor = CUDAGraphMode.FULL, BatchDescriptor(4, True)
    monkeypatch.setattr(torchair, "get_forward_context", lambda: ctx)
    import vllm.forward_context

    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ctx)
    wrapper = object.__new__(torchair.TorchairWrapper)
    wrapper.runnable, wrapper.runtime_mode = (model := _Recorder()), CUDAGraphMode.FULL
    wrapper.compiled = {}
    eager = torchair.TORCHAIR_STATS.eager_calls
    out = wrapper(**_kwargs(1))
    assert model.seen == [(4, [4, 4])] and out.shape == (1, 3)
    assert wrapper.compiled == {} and torchair.TORCHAIR_STATS.eager_calls == eager + 1


def _eager_wrapper(monkeypatch, ctx: SimpleNamespace) -> tuple[object, _Recorder]:
    import vllm.forward_context
    from vllm.config import CUDAGraphMode
    from vllm_npu.platform.graphs import torchair

    monkeypatch.setattr(torchair, "get_forward_context", lambda: ctx)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ctx)
    wrapper = object.__new__(torchair.TorchairWrapper)
    wrapper.runnable, wrapper.runtime_mode = (model := _Recorder()), CUDAGraphMode.FULL
    wrapper.compiled = {}
    return wrapper, model


def test_a_dummy_batch_beside_another_ranks_prefill_runs_at_that_ranks_count(monkeypatch):
    """vLLM's DP dummy batch while the other rank runs a 20-token prefill: runtime mode NONE, no descriptor, the
    forward context's counts [20, 20], one row. Handed one row, the MoE exchange met 20 on the other rank (the layer
    refused: "the DP ranks hold [20, 20] tokens this step, this rank's MoE input 1"); it runs with 20 and returns
    its one."""
    from vllm.config import CUDAGraphMode

    ctx = _context([20, 20])
    ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
    wrapper, model = _eager_wrapper(monkeypatch, ctx)
    out = wrapper(**_kwargs(1))
    assert model.seen == [(20, [20, 20])] and out.shape == (1, 3)
    assert torch.equal(out, torch.full((1, 3), 2.0)) and wrapper.compiled == {}


@pytest.mark.parametrize("counts", [None, [6, 6]], ids=["no-dp", "agreeing"])
def test_an_eager_step_with_metadata_or_agreeing_counts_is_unpadded(monkeypatch, counts):
    """A real eager step (attention metadata set) and a dummy batch that already holds the count run as given."""
    from vllm.config import CUDAGraphMode

    ctx = _context(counts)
    ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
    wrapper, model = _eager_wrapper(monkeypatch, ctx)
    ctx.attn_metadata = {"layer": object()}
    assert wrapper(**_kwargs(3)).shape == (3, 3)
    ctx.attn_metadata = None
    assert wrapper(**_kwargs(6)).shape == (6, 3)
    assert [rows for rows, _ in model.seen] == [3, 6]
