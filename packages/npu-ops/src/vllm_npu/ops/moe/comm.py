# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Token dispatchers: move routed rows to the experts that own them, run the experts, and combine.

A dispatcher is ``dispatcher(hidden [T, H], topk_weights [T, k] f32, topk_ids [T, k] int, experts: ExpertsFn) -> [T, H]``.

- :class:`LocalDispatcher`: no communication. Without expert parallelism it runs every expert. With expert
  parallelism over replicated tokens (vLLM's default EP: the EP group is the TP group and every rank holds the same
  tokens) it runs this rank's experts only and returns a partial sum; vLLM's usual all-reduce after the MoE adds
  the ranks up, exactly as with vLLM's own kernels.
- :class:`AllToAllDispatcher`: expert parallelism over *different* tokens per rank (data parallel attention). Rows
  are sent to the ranks owning their experts with a variable-size all-to-all, computed there, sent back and
  combined locally. The result is complete on every rank (no reduction afterwards).

Placement follows vLLM's ``determine_expert_map`` (``linear`` or ``round_robin``), given as the per-rank expert maps,
or an :class:`~.placement.ExpertPlacement` (``npu.expert_map_path``: any placement, redundant replicas included), whose
replica choice turns each routed logical expert into one physical slot.

Expert load (dynamic EPLB): a dispatcher with a placement adds the rows it routes to ``placement.load`` so that the
sum over the EP ranks counts every (token, slot) pair once: the local dispatcher counts its own slots' rows (every
rank holds the same tokens), the all-to-all dispatcher its own tokens' rows, MC2 its token share's rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .capture import host_ints, in_graph_step
from .experts import ExpertsFn
from .placement import ExpertPlacement, static_table
from .routing import InitRouting, Unpermute, combine_masked

# (input [N, ...], output_split_sizes, input_split_sizes) -> output [sum(output_split_sizes), ...]
AllToAll = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def run_experts(experts: ExpertsFn, rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
    """``experts(rows, group_counts)``, skipped when this rank got no rows (an empty grouped matmul is not a case
    the NPU op documents, and there is nothing to compute)."""
    if rows.shape[0] == 0:
        return rows.new_empty(rows.shape)
    return experts(rows, group_counts)


@dataclass
class LocalDispatcher:
    """Route, run the local experts, combine; no communication.

    ``expert_map`` [E] int (global id -> local id, -1 when not local) or None when every expert is local. With a
    ``placement`` (and this ``rank``) instead, each routed expert is first mapped to its chosen replica (offset 0:
    every rank holding the same tokens makes the same choice, so each slot is computed on exactly one rank).
    """

    num_experts: int
    init_routing: InitRouting
    unpermute: Unpermute
    expert_map: torch.Tensor | None = None
    placement: ExpertPlacement | None = None
    rank: int = 0
    #: the full-permutation combine while Dynamo traces (a torchair decode graph): ``npu_moe_finalize_routing``,
    #: which GE converts; None: ``unpermute`` there too
    graph_unpermute: Unpermute | None = None

    def __post_init__(self) -> None:
        if self.placement is not None:
            if self.placement.num_logical != self.num_experts:
                raise ValueError(f"placement has {self.placement.num_logical} experts, expected {self.num_experts}")
            self.num_local = self.placement.local_counts[self.rank]
            start = self.placement.offsets[self.rank]
            physical = torch.arange(self.placement.num_physical)
            mine = (physical >= start) & (physical < start + self.num_local)
            # physical id -> local id, the sentinel num_local for other ranks' slots
            self._local_id = static_table(torch.where(mine, physical - start, self.num_local).long())
        elif self.expert_map is None:
            self.num_local = self.num_experts
        else:
            if self.expert_map.numel() != self.num_experts:
                raise ValueError(f"expert_map has {self.expert_map.numel()} entries, expected {self.num_experts}")
            self.num_local = int((self.expert_map >= 0).sum())
            # Non-local experts map to one sentinel id past the local range, which init_routing leaves out.
            self._local_id = static_table(torch.where(self.expert_map >= 0, self.expert_map, self.num_local).long())

    def __call__(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertsFn
    ) -> torch.Tensor:
        # Traced into a compiled graph (torchair): only ops with GE converters (the finalize instead of the
        # unpermute). Traced or captured into an ACL graph (.capture): no host reads, every row goes to the experts
        # (see below). Eager steps keep the eager kernels.
        compiled, no_host_reads = torch.compiler.is_compiling(), in_graph_step()
        if self.expert_map is None and self.placement is None:
            rows, row_idx, counts = self.init_routing(hidden, topk_ids, self.num_experts, (0, self.num_experts))
            unpermute = self.graph_unpermute if compiled and self.graph_unpermute is not None else self.unpermute
            return unpermute(run_experts(experts, rows, counts), row_idx, topk_weights)
        if self._local_id.device != topk_ids.device:  # once, if the layer moved after it was built
            self._local_id = static_table(self._local_id.to(topk_ids.device))
        if self.placement is not None:
            local_ids = self._local_id[self.placement.to(topk_ids.device).choose(topk_ids)]
        else:
            local_ids = self._local_id[topk_ids.long()]
        rows, row_idx, counts = self.init_routing(hidden, local_ids, self.num_local + 1, (0, self.num_local))
        if self.placement is not None:
            # Rows of this rank's own slots only: with replicated tokens each row is then counted on one rank.
            self.placement.record_counts(counts, self.placement.offsets[self.rank])
        if no_host_reads:
            # No host read of the row count: every row goes to the grouped matmul, whose counts cover the in-range
            # rows only (the rest come out undefined, as in vllm-ascend v0.11.0's torchair expert-parallel MoE), and
            # the combine drops the rows marked -1, whatever they hold.
            return combine_masked(run_experts(experts, rows, counts), row_idx, topk_weights, out_dtype=hidden.dtype)
        # Eager: the grouped matmul gets exactly the rows its counts cover (the in-range ones).
        n = int(counts.sum())
        return combine_masked(run_experts(experts, rows[:n], counts), row_idx[:n], topk_weights, out_dtype=hidden.dtype)


def torch_all_to_all(group: Any) -> AllToAll:
    """A variable-split all-to-all over a ``torch.distributed`` process group (gloo on the emulated device)."""
    import torch.distributed as dist

    def all_to_all(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out

    return all_to_all


def coordinator_all_to_all(coordinator: Any) -> AllToAll:
    """The all-to-all of a vLLM ``GroupCoordinator`` (the EP group): its device communicator's when it has one.

    Our platform's ``NPUCommunicator.all_to_all(input_, output_split_sizes, input_split_sizes)`` (HCCL on the NPU,
    gloo on the emulated device) is used as is; a group without it falls back to ``all_to_all_single`` on the
    group's device process group.
    """
    comm = getattr(coordinator, "device_communicator", None)
    method = getattr(comm, "all_to_all", None)
    if method is not None:
        params = inspect.signature(method).parameters
        if {"output_split_sizes", "input_split_sizes"} <= params.keys():

            def all_to_all(
                x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]
            ) -> torch.Tensor:
                return method(x, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes)

            return all_to_all
    return torch_all_to_all(coordinator.device_group)


@dataclass
class AllToAllDispatcher:
    """Expert parallelism over different tokens per rank, with a variable-size all-to-all (eager steps only: its
    split sizes are read on the host, which a captured graph refuses; :mod:`.capture`).

    ``expert_maps[r]`` is rank r's expert map ([E] int: global -> local id, -1 elsewhere), or ``placement`` gives
    the slots (redundant replicas allowed; this rank's tokens choose replicas with offset ``rank``). Per call: route rows by (owner rank, local id); exchange the per-expert counts; all-to-all the
    rows; re-sort the received rows by local expert (they arrive grouped by source rank); run the experts; undo the
    re-sort; all-to-all back; combine with the routing weights.
    """

    num_experts: int
    rank: int
    expert_maps: Sequence[torch.Tensor]
    all_to_all: AllToAll
    init_routing: InitRouting
    unpermute: Unpermute
    placement: ExpertPlacement | None = None

    def __post_init__(self) -> None:
        if self.placement is None:
            self.placement = ExpertPlacement.from_expert_maps(self.expert_maps)
        if self.placement.num_logical != self.num_experts:
            raise ValueError(f"expert maps have {self.placement.num_logical} experts, expected {self.num_experts}")
        self.world = self.placement.world
        self.local_counts = self.placement.local_counts  # slots per rank
        self.max_local = max(self.local_counts)
        # Physical ids number the slots rank by rank, so one sort groups rows by owner then by local expert.
        # Where each physical expert's row count goes in the flat [R * max_local] count table (padding stays 0):
        # one scatter per call instead of a copy per rank.
        self._count_slot = torch.cat([r * self.max_local + torch.arange(n) for r, n in enumerate(self.local_counts)])

    def __call__(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertsFn
    ) -> torch.Tensor:
        device = hidden.device
        if self._count_slot.device != device:  # once: the tables are built on the CPU
            self._count_slot = self._count_slot.to(device)
        assert self.placement is not None
        physical = self.placement.to(device).choose(topk_ids, offset=self.rank)
        total = self.placement.num_physical
        rows, row_idx, counts = self.init_routing(hidden, physical, total, (0, total))
        self.placement.record_counts(counts)  # this rank's tokens, per physical expert
        # counts per (destination rank, its local expert), padded to max_local: [R, L]
        send = torch.zeros(self.world * self.max_local, dtype=torch.int64, device=device)
        send[self._count_slot] = counts.long()
        send = send.view(self.world, self.max_local)
        recv = self.all_to_all(send, [1] * self.world, [1] * self.world).view(self.world, self.max_local)
        # one device->host copy; refused inside a captured graph (.capture: the layer then takes a static exchange)
        send_splits, recv_splits = host_ints(torch.stack((send.sum(1), recv.sum(1))), "the all-to-all split sizes")
        received = self.all_to_all(rows, recv_splits, send_splits)
        # Received rows: by source rank, each chunk sorted by local expert. Sort stably by local expert.
        n_local = self.local_counts[self.rank]
        per_source_expert = recv[:, :n_local].reshape(-1)
        expert_of_row = torch.arange(n_local, device=device).repeat(self.world).repeat_interleave(per_source_expert)
        order = torch.sort(expert_of_row, stable=True).indices
        group_counts = recv[:, :n_local].sum(0)
        out_sorted = run_experts(experts, received.index_select(0, order), group_counts)
        out_received = torch.empty_like(out_sorted)
        out_received[order] = out_sorted
        returned = self.all_to_all(out_received, send_splits, recv_splits)
        return self.unpermute(returned, row_idx, topk_weights).to(hidden.dtype)
