# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Data parallelism in the torchair mode: every DP rank runs each forward at one size (the target's dummy batches and
the EAGLE / MTP draft's passes), and as many draft passes per step.

vLLM's dummy batch (``execute_dummy_batch``: a DP rank without requests while others step) runs ``_dummy_run(1)``
with the batch descriptor of the DP-padded size and runtime mode FULL, but hands the model the unpadded one row and
no attention metadata (on CUDA the replayed graph reads its own persistent buffers, so the row count never shows).
A compiled size called with one row recompiles; run eagerly with one row, the MoE exchange sees one row against the
other ranks' padded count. :func:`run_dummy_at` pads it to the descriptor's size; the wrapper runs it eagerly
(there is no metadata to lay out as graph inputs). While another rank runs a prefill or mixed step (mode NONE, no
descriptor) the dummy batch gets the same one row against that rank's count: it is padded to the forward context's
largest count (:func:`dp_pass_size`).

The MoE exchange in the compiled graph has static shapes (the all-gather / reduce-scatter or MC2 of npu-ops'
``AscendFusedMoE``), so every DP rank must hand it the same row count. vLLM pads the target's steps across DP
(``GPUModelRunner.get_dp_padding``), but vLLM 0.11's ``EagleProposer`` pads each draft pass to a capture size of
its own batch only (``propose``: ``pad_for_cudagraph(num_tokens)``), and a rank without requests runs
``dummy_run(num_tokens)`` with the unpadded count: the ranks' sizes differ ([8, 1] for three requests against a
dummy step) and the MoE layer refuses the step. vllm-ascend v0.11.0's MTP proposer pads its torchair draft passes to
the target step's DP-synced size (``spec_decode/mtp_proposer.py:377-379, 433-435``) and syncs the others
(``:427-431``). Here every pass pads to the largest count in the pass's forward context (vLLM all-reduces the
ranks' counts when the proposer opens it, ``DPMetadata.make``), so no extra collective: :func:`dp_padded_pass`.

A step of ``k`` draft passes on a rank with requests meets one ``dummy_run`` pass on a rank without: the ranks'
collectives (the count all-reduce and the MoE exchange of each pass) would pair up wrongly and hang for ``k > 1``.
vllm-ascend's ``dummy_run`` runs ``num_speculative_tokens`` passes (``mtp_proposer.py:150``);
:func:`dummy_runs_every_pass` makes vLLM's do the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: forward() arguments holding one row per token in dimension 0 (``positions``: the last dimension, for M-RoPE)
_TOKEN_ARGS = ("input_ids", "hidden_states", "inputs_embeds")


def dp_pass_size(size: int) -> int:
    """The size every DP rank runs this draft pass at: the largest of the ranks' counts in the forward context
    (``size`` itself without data parallelism)."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().dp_metadata
    if meta is None:
        return size
    return max(size, int(meta.num_tokens_across_dp_cpu.max()))


def run_dummy_at(runnable: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], size: int) -> Any:
    """vLLM's DP dummy batch (``execute_dummy_batch``: ``_dummy_run(1)``, no attention metadata) run by ``runnable``
    with its token arguments padded with zero rows to ``size`` (the other ranks' count), its output cut back to its
    own rows. Unpadded when it holds ``size`` rows or more, or has no token arguments. vLLM pads the forward context's
    DP counts to the largest rank's but hands the model the one row; vllm-ascend's ``_dummy_run`` runs the model at
    the DP-synced count (``worker/model_runner_v1.py:2397-2399``)."""
    rows = token_rows(kwargs)
    if rows < 0 or rows >= size:
        return runnable(*args, **kwargs)
    return unpad_rows(runnable(*args, **pad_token_args(kwargs, size)), rows)


def _pad_rows(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = rows - shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def token_rows(kwargs: dict[str, Any]) -> int:
    """The forward's token count (``positions``' last dimension), -1 when it has none."""
    positions = kwargs.get("positions")
    return int(positions.shape[-1]) if isinstance(positions, torch.Tensor) else -1


def pad_token_args(kwargs: dict[str, Any], rows: int) -> dict[str, Any]:
    """``kwargs`` with the per-token arguments padded with zero rows to ``rows`` tokens (unchanged when they hold
    that many or more)."""
    if token_rows(kwargs) >= rows:
        return kwargs
    out = dict(kwargs)
    for name in _TOKEN_ARGS:
        if isinstance(out.get(name), torch.Tensor):
            out[name] = _pad_rows(out[name], rows, 0)
    if isinstance(out.get("positions"), torch.Tensor):
        out["positions"] = _pad_rows(out["positions"], rows, -1)
    return out


@contextlib.contextmanager
def dp_padded_pass(kwargs: dict[str, Any], size: int) -> Iterator[tuple[dict[str, Any], int]]:
    """``(kwargs, padded size)`` for a draft pass of ``size`` tokens: the token arguments padded with zero rows to
    :func:`dp_pass_size` and, meanwhile, the forward context's DP counts all that size (what the MoE exchange reads;
    also on the rank that holds the largest count, whose rows stay as they are). Unchanged when the counts agree."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    meta = context.dp_metadata
    if meta is None or bool((meta.num_tokens_across_dp_cpu == size).all()):
        yield kwargs, size
        return
    padded = dp_pass_size(size)
    out = pad_token_args(kwargs, padded)
    counts = torch.full_like(meta.num_tokens_across_dp_cpu, padded)
    context.dp_metadata = dataclasses.replace(
        meta, num_tokens_across_dp_cpu=counts, max_tokens_across_dp_cpu=counts.max()
    )
    try:
        yield out, padded
    finally:
        context.dp_metadata = meta


def unpad_rows(output: Any, size: int) -> Any:
    """The draft model's output (a tensor, or a tuple of them: EAGLE's two hidden states) cut back to ``size``
    rows."""
    if isinstance(output, torch.Tensor):
        return output[:size]
    if isinstance(output, tuple):
        return tuple(unpad_rows(o, size) for o in output)
    return output


def dummy_runs_every_pass(dummy_run: Callable[[int], None], passes: int) -> Callable[[int], None]:
    """vLLM's ``EagleProposer.dummy_run`` run ``passes`` times (``num_speculative_tokens``): a DP rank without
    requests then meets each draft pass of the ranks with requests."""

    def run(num_tokens: int) -> None:
        for _ in range(passes):
            dummy_run(num_tokens)

    return run
