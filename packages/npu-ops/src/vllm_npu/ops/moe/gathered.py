# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The data-parallel MoE exchange of equal-sized ranks: all-gather, local experts, reduce-scatter.

When every rank of the group holds the same number of tokens (vLLM pads every DP rank's batch to the largest one,
``get_dp_padding``, whenever it does not run ``--enforce-eager``: always in the torchair mode), the exchange needs no
size read on the host: :func:`all_gather_rows` / :func:`reduce_scatter_rows` are ``torch.distributed``'s functional
collectives over the group's device process group (HCCL on the NPU, where torch_npu 2.8.0's torchair converts
``_c10d_functional.all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``wait_tensor``; gloo on the emulated
device), with static shapes ``[W * T, ...]`` and ``[T, ...]``. This is vllm-ascend v0.11.0's torchair
``FusedMoEState.AllGather``: its model runner pads every DP rank to one graph batch size, then the layer all-gathers
over the DP group and reduce-scatters the experts' sums back (``torchair_fused_moe.py``).

:class:`GatheredDispatcher` is a token dispatcher (``(hidden [T, H], topk_weights, topk_ids, experts) -> [T, H]``) for
ranks holding different tokens: gather every rank's rows and routing, run this rank's experts over all of them with
the local dispatcher (a partial sum per token), reduce-scatter: each rank gets its own tokens' complete output.

:func:`dp_padded_rows` is the count every rank hands these exchanges in an eager step, from vLLM's forward context;
vLLM's DP dummy batch (a rank without requests beside another rank's step) holds fewer rows than that count, and
the layer pads it with :func:`pad_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .comm import LocalDispatcher
from .experts import ExpertsFn


def all_gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[T, ...]`` on each of the W ranks of ``group`` -> ``[W * T, ...]`` in rank order (every rank the same T)."""
    from torch.distributed import _functional_collectives as fc

    return fc.wait_tensor(fc.all_gather_tensor(x.contiguous(), 0, group))  # a plain tensor, eager too


def reduce_scatter_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[W * T, ...]`` on each rank -> rank r's ``[T, ...]`` block of the sum over the ranks."""
    from torch.distributed import _functional_collectives as fc

    return fc.wait_tensor(fc.reduce_scatter_tensor(x.contiguous(), "sum", 0, group))


def dp_padded_rows(hidden: torch.Tensor, dp_rank: int) -> int:
    """Eager steps with DP padding: the row count every DP rank hands the static exchanges (vLLM's forward context
    holds the counts on the host), ``hidden``'s own outside a DP step or while traced (the compiled size).

    Larger than ``hidden``'s rows on vLLM's DP dummy batch (``execute_dummy_batch`` -> ``_dummy_run(1)``: the counts
    are padded to the largest rank's, the model input stays one row); the caller pads to it. Counts that differ
    between ranks, or an input larger than this rank's count, are an error.
    """
    rows = int(hidden.shape[0])
    if torch.compiler.is_compiling():
        return rows  # the compiled size; vLLM pads every DP rank's step to it
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().dp_metadata
    if meta is None:
        return rows
    counts = meta.num_tokens_across_dp_cpu.tolist()
    if any(n != counts[0] for n in counts) or rows > counts[dp_rank]:
        raise RuntimeError(
            f"the DP ranks hold {counts} tokens this step, this rank's MoE input {rows}; with graphs on "
            "(torchair, PIECEWISE, FULL_DECODE_ONLY) the MoE exchange needs every DP rank padded to one size (vLLM "
            "pads them unless --enforce-eager)"
        )
    return int(counts[dp_rank])


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (dimension 0)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


@dataclass
class GatheredDispatcher:
    """Tokens of every rank gathered, this rank's experts over all of them, sums scattered back (see the module
    docstring). ``local`` runs this rank's experts over replicated tokens (its placement's replica choice has offset
    0, so every rank picks the same replica); ``group`` is the exchange's process group (the EP group's device
    group), ``world`` its size. The result is complete for this rank's tokens (no all-reduce afterwards)."""

    local: LocalDispatcher
    group: Any
    world: int

    def __call__(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertsFn
    ) -> torch.Tensor:
        rows = all_gather_rows(hidden, self.group)
        weights = all_gather_rows(topk_weights, self.group)
        ids = all_gather_rows(topk_ids, self.group)
        return reduce_scatter_rows(self.local(rows, weights, ids, experts), self.group)
