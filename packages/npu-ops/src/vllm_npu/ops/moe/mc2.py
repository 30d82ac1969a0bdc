# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""MC2: expert-parallel dispatch and combine fused with their communication, and the dispatcher that runs them.

Kernel pair (torch_npu 2.8.0 ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2``; their written
contract in 2.8.0 is the meta registration, ``torch_npu/op_plugin/meta/_meta_registrations.py``)::

    mc2_dispatch(x [BS, H], expert_ids [BS, K] int (physical ids), comm, num_experts P, global_bs G, quant)
        -> MC2Dispatch(expand_x [A, H]        the rows this rank's experts must compute, A = G * min(L, K) with
                                              L = P / W local experts: the token capacity; rows ordered by (local
                                              expert, source rank, source slot), valid up to sum(expert_token_nums)
                       dynamic_scales [A] f32  per-row int8 scales when ``quant`` (quant_mode 2: the rows are
                                              dynamically quantised per token before they travel; expand_x is int8)
                       assist_info [max(BS*K, A*128)] int32  what combine needs to send rows back
                       expert_token_nums [L] int64          rows per local expert (counts: expert_token_nums_type=1)
                       ep_recv_counts [W*L] int32           received rows per (local expert, source rank)
                       tp_recv_counts, expand_scales)
    mc2_combine(expert_out [A, H], expert_ids, dispatched, expert_scales [BS, K] f32, comm, P, G) -> [BS, H]
        out[t] = sum_j expert_scales[t, j] * expert_out[row of slot (t, j)]   (in expert_out's dtype)

G is ``max tokens per rank * W`` (every rank may hold a different BS up to that), the same on every rank. On the NPU
the assist info and receive counts are the kernel's own (passed back to combine unread). The reference twin runs
over ``all_to_all_single`` on gloo and fills them as the kernel's documentation describes them, in plain layouts:
``assist_info[3i : 3i+3] = (source rank, source token, source slot)`` of expanded row i (-1 past the valid rows),
``ep_recv_counts`` the cumulative counts over (local expert, source rank), expert-major.

:class:`MC2Dispatcher` is a token dispatcher (``(hidden, topk_weights, topk_ids, experts) -> [T, H]``) over that
pair: ranks holding different tokens (data-parallel attention) send their own tokens; ranks holding the same tokens
(vLLM's default expert parallelism) each take a slice of them and return that slice's output in an otherwise-zero
[T, H], so vLLM's all-reduce after the MoE assembles the whole (as it sums the local dispatcher's partial sums).
:class:`StepDispatcher` chooses MC2 or the other dispatcher per call by the step's token count (rule:
:func:`mc2_candidate` and :func:`mc2_tokens_capacity`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from vllm_npu.interface import ConfigError, Kernel, KernelBackend

from .capture import in_graph_step
from .experts import ExpertsFn
from .placement import ExpertPlacement

AllToAll = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]

#: The ceiling of the MC2 token capacity per step (vllm-ascend v0.11.0 caps it at 512 to bound the HCCL window).
MC2_MAX_CAPACITY = 512


#: The reference twin's groups by key: the twin's exchange runs inside a registered op (one opaque node in a
#: compiled graph, as the NPU kernel is), which takes the group as a string.
_TWIN_GROUPS: dict[str, MC2Comm] = {}


@dataclass(frozen=True)
class MC2Comm:
    """The communication group of the MC2 kernels: the expert-parallel group.

    ``group_name`` is its HCCL communicator name (NPU); ``all_to_all`` its variable-split all-to-all (the twin's
    exchange, gloo on the emulated device); ``soc`` the chip family ("A2", "A3", or "" when unknown), which decides
    the extra arguments A3 takes. ``twin_key`` (set when ``all_to_all`` is given) names the group for the twin's
    registered ops.
    """

    rank: int
    world: int
    all_to_all: AllToAll | None = None
    group_name: str = ""
    soc: str = ""
    twin_key: str = field(default="", init=False, compare=False)

    def __post_init__(self) -> None:
        if self.all_to_all is not None:
            key = f"mc2-{len(_TWIN_GROUPS)}"
            _TWIN_GROUPS[key] = self
            object.__setattr__(self, "twin_key", key)


class MC2Dispatch(NamedTuple):
    expand_x: torch.Tensor
    dynamic_scales: torch.Tensor
    assist_info: torch.Tensor
    expert_token_nums: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor
    expand_scales: torch.Tensor


class MC2DispatchFn(Protocol):
    def __call__(
        self, x: torch.Tensor, expert_ids: torch.Tensor, comm: MC2Comm, num_experts: int, global_bs: int, quant: bool
    ) -> MC2Dispatch: ...


class MC2CombineFn(Protocol):
    def __call__(
        self,
        expert_out: torch.Tensor,
        expert_ids: torch.Tensor,
        dispatched: MC2Dispatch,
        expert_scales: torch.Tensor,
        comm: MC2Comm,
        num_experts: int,
        global_bs: int,
    ) -> torch.Tensor: ...


def _a3_args(comm: MC2Comm) -> dict[str, Any]:
    # vllm-ascend v0.11.0 (ops/moe/token_dispatcher.py, need_extra_args): A3 takes the TP-domain arguments too; its
    # torchair MoE passes them in a compiled graph on every chip (torchair_fused_moe.py: "when in A3 or in torchair
    # graph, we need to pass in some extra param").
    if comm.soc == "A3" or torch.compiler.is_compiling():
        return {"group_tp": comm.group_name, "tp_world_size": 1, "tp_rank_id": 0}
    return {}


def mc2_dispatch_npu(
    x: torch.Tensor, expert_ids: torch.Tensor, comm: MC2Comm, num_experts: int, global_bs: int, quant: bool
) -> MC2Dispatch:
    """``npu_moe_distribute_dispatch_v2`` (no shared-expert ranks, counts per local expert)."""
    import torch_npu

    out = torch_npu.npu_moe_distribute_dispatch_v2(
        x,
        expert_ids.to(torch.int32),
        comm.group_name,
        comm.world,
        comm.rank,
        num_experts,
        expert_shard_type=0,
        shared_expert_rank_num=0,
        quant_mode=2 if quant else 0,
        global_bs=global_bs,
        expert_token_nums_type=1,
        **_a3_args(comm),
    )
    return MC2Dispatch(*out[:7])


def mc2_combine_npu(
    expert_out: torch.Tensor,
    expert_ids: torch.Tensor,
    dispatched: MC2Dispatch,
    expert_scales: torch.Tensor,
    comm: MC2Comm,
    num_experts: int,
    global_bs: int,
) -> torch.Tensor:
    """``npu_moe_distribute_combine_v2`` over what :func:`mc2_dispatch_npu` returned."""
    import torch_npu

    extra = _a3_args(comm)
    if extra:
        extra["tp_send_counts"] = dispatched.tp_recv_counts
    return torch_npu.npu_moe_distribute_combine_v2(
        expert_out,
        expert_ids.to(torch.int32),
        dispatched.assist_info,
        dispatched.ep_recv_counts,
        expert_scales.to(torch.float32),
        comm.group_name,
        comm.world,
        comm.rank,
        num_experts,
        expand_scales=dispatched.expand_scales,
        expert_shard_type=0,
        shared_expert_rank_num=0,
        global_bs=global_bs,
        **extra,
    )


def _check(x: torch.Tensor, expert_ids: torch.Tensor, comm: MC2Comm, num_experts: int, global_bs: int) -> int:
    if comm.all_to_all is None:
        raise ValueError("the MC2 reference twin needs the group's all_to_all (MC2Comm.all_to_all)")
    if num_experts % comm.world:
        raise ValueError(f"MC2 needs the {num_experts} physical experts split evenly over {comm.world} ranks")
    if global_bs % comm.world or x.shape[0] > global_bs // comm.world:
        raise ValueError(
            f"MC2: {x.shape[0]} tokens on rank {comm.rank} exceed the capacity global_bs / world = "
            f"{global_bs} / {comm.world}"
        )
    if expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids has {expert_ids.shape[0]} rows, x {x.shape[0]}")
    return num_experts // comm.world


def _dynamic_quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 (``npu_dynamic_quant``'s maths): scale = rowmax|x| / 127, y = round(x / scale)."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / 127.0 if x.shape[0] else xf.new_zeros(0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(xf / safe.unsqueeze(-1)), -127, 127).to(torch.int8), scale


def _dispatch_exchange(
    x: torch.Tensor, expert_ids: torch.Tensor, comm: MC2Comm, num_experts: int, global_bs: int, quant: bool
) -> MC2Dispatch:
    """The twin's dispatch (three all-to-alls: counts, rows with their scales, origins); reads sizes on the host."""
    local = _check(x, expert_ids, comm, num_experts, global_bs)
    assert comm.all_to_all is not None
    world, (bs, k), hidden = comm.world, expert_ids.shape, x.shape[1]
    device = x.device
    capacity = global_bs * min(local, k)
    flat = expert_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices  # by destination rank, then local expert, then slot
    send = torch.bincount(flat, minlength=num_experts).view(world, local)
    recv = comm.all_to_all(send, [1] * world, [1] * world).view(world, local)  # [source rank, local expert]
    send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    payload, scales = _dynamic_quant_rows(x) if quant else (x, x.new_zeros(bs, dtype=torch.float32))
    token = order // k
    origin = torch.stack((torch.full_like(order, comm.rank), token, order % k), 1).to(torch.int32)
    rows = comm.all_to_all(payload.index_select(0, token), recv_splits, send_splits)
    row_scales = comm.all_to_all(scales.index_select(0, token).unsqueeze(1), recv_splits, send_splits).squeeze(1)
    origins = comm.all_to_all(origin, recv_splits, send_splits)
    # Received: by source rank, each chunk by local expert. Reorder stably by local expert.
    expert_of_row = torch.arange(local, device=device).repeat(world).repeat_interleave(recv.reshape(-1))
    by_expert = torch.sort(expert_of_row, stable=True).indices
    n = int(by_expert.numel())
    expand_x = torch.zeros(capacity, hidden, dtype=payload.dtype, device=device)
    expand_x[:n] = rows.index_select(0, by_expert)
    dynamic_scales = torch.zeros(capacity, dtype=torch.float32, device=device)
    dynamic_scales[:n] = row_scales.index_select(0, by_expert)
    assist_info = torch.full((max(bs * k, capacity * 128),), -1, dtype=torch.int32, device=device)
    assist_info[: 3 * n] = origins.index_select(0, by_expert).reshape(-1)
    return MC2Dispatch(
        expand_x,
        dynamic_scales,
        assist_info,
        recv.sum(0).to(torch.int64),
        recv.t().reshape(-1).cumsum(0).to(torch.int32),
        torch.zeros(0, dtype=torch.int32, device=device),
        torch.zeros(0, dtype=torch.float32, device=device),
    )


def _combine_exchange(
    expert_out: torch.Tensor,
    expert_ids: torch.Tensor,
    ep_recv_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    comm: MC2Comm,
    num_experts: int,
) -> torch.Tensor:
    """The twin's combine: rows back to their source ranks, weighted sum there (float32); reads sizes on the host."""
    world = comm.world
    if comm.all_to_all is None or num_experts % world:
        raise ValueError("the MC2 reference twin needs the group's all_to_all and evenly split experts")
    local = num_experts // world
    (bs, k), hidden = expert_ids.shape, expert_out.shape[1]
    cumulative = ep_recv_counts[: local * world].long()
    per = torch.diff(cumulative, prepend=cumulative.new_zeros(1)).view(local, world)  # [local expert, source]
    n = int(per.sum())
    source_of_row = torch.arange(world, device=expert_out.device).repeat(local).repeat_interleave(per.reshape(-1))
    by_source = torch.sort(source_of_row, stable=True).indices  # back to each source's send order
    flat = expert_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    mine = torch.bincount(flat, minlength=num_experts).view(world, local).sum(1).tolist()
    returned = comm.all_to_all(expert_out[:n].index_select(0, by_source), mine, per.sum(0).tolist())
    weight = expert_scales.reshape(-1).float().index_select(0, order)
    out = torch.zeros(bs, hidden, dtype=torch.float32, device=expert_out.device)
    out.index_add_(0, order // k, returned.float() * weight.unsqueeze(1))
    return out.to(expert_out.dtype)


def _twin_group(key: str) -> MC2Comm:
    comm = _TWIN_GROUPS.get(key)
    if comm is None:
        raise ValueError(f"MC2 twin: no group {key!r} (an MC2Comm built with its all_to_all registers one)")
    return comm


def _capacity(expert_ids: torch.Tensor, world: int, num_experts: int, global_bs: int) -> int:
    return global_bs * min(max(num_experts // world, 1), expert_ids.shape[1])


@torch.library.custom_op("vllm_npu::mc2_dispatch", mutates_args=())
def _mc2_dispatch_op(
    x: torch.Tensor, expert_ids: torch.Tensor, group: str, num_experts: int, global_bs: int, quant: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_dispatch_exchange(x, expert_ids, _twin_group(group), num_experts, global_bs, quant))  # type: ignore[return-value]


def dispatch_outputs_like(
    x: torch.Tensor, expert_ids: torch.Tensor, world: int, num_experts: int, global_bs: int, quant: bool
) -> tuple[torch.Tensor, ...]:
    """Empty tensors of the dispatch's output shapes and dtypes (the module docstring's; fake implementations)."""
    capacity, (bs, k) = _capacity(expert_ids, world, num_experts, global_bs), expert_ids.shape
    return (
        x.new_empty(capacity, x.shape[1], dtype=torch.int8 if quant else x.dtype),
        x.new_empty(capacity, dtype=torch.float32),
        x.new_empty(max(bs * k, capacity * 128), dtype=torch.int32),
        x.new_empty(num_experts // world, dtype=torch.int64),
        x.new_empty(num_experts, dtype=torch.int32),
        x.new_empty(0, dtype=torch.int32),
        x.new_empty(0, dtype=torch.float32),
    )


_mc2_dispatch_op.register_fake(
    lambda x, expert_ids, group, num_experts, global_bs, quant: dispatch_outputs_like(
        x, expert_ids, _twin_group(group).world, num_experts, global_bs, quant
    )
)


@torch.library.custom_op("vllm_npu::mc2_combine", mutates_args=())
def _mc2_combine_op(
    expert_out: torch.Tensor,
    expert_ids: torch.Tensor,
    ep_recv_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    group: str,
    num_experts: int,
) -> torch.Tensor:
    return _combine_exchange(expert_out, expert_ids, ep_recv_counts, expert_scales, _twin_group(group), num_experts)


_mc2_combine_op.register_fake(
    lambda expert_out, expert_ids, counts, scales, group, num_experts: expert_out.new_empty(
        expert_ids.shape[0], expert_out.shape[1]
    )
)


def mc2_dispatch_reference(
    x: torch.Tensor, expert_ids: torch.Tensor, comm: MC2Comm, num_experts: int, global_bs: int, quant: bool
) -> MC2Dispatch:
    """Reference twin of :func:`mc2_dispatch_npu` (three all-to-alls: counts, rows with their scales, origins).

    The exchange reads its split sizes on the host, so it runs inside the registered op
    ``torch.ops.vllm_npu.mc2_dispatch`` (outputs of the kernel's static shapes): a compiled graph holds one opaque
    node, as it holds the NPU kernel's.
    """
    if comm.all_to_all is None:
        raise ValueError("the MC2 reference twin needs the group's all_to_all (MC2Comm.all_to_all)")
    return MC2Dispatch(*torch.ops.vllm_npu.mc2_dispatch(x, expert_ids, comm.twin_key, num_experts, global_bs, quant))


def mc2_combine_reference(
    expert_out: torch.Tensor,
    expert_ids: torch.Tensor,
    dispatched: MC2Dispatch,
    expert_scales: torch.Tensor,
    comm: MC2Comm,
    num_experts: int,
    global_bs: int,
) -> torch.Tensor:
    """Reference twin of :func:`mc2_combine_npu`: rows back to their source ranks, weighted sum there (float32),
    inside the registered op ``torch.ops.vllm_npu.mc2_combine`` (it reads the received counts on the host). Only the
    rows the counts cover are read: the rest of ``expert_out`` may hold anything."""
    if comm.all_to_all is None or num_experts % comm.world:
        raise ValueError("the MC2 reference twin needs the group's all_to_all and evenly split experts")
    return torch.ops.vllm_npu.mc2_combine(
        expert_out, expert_ids, dispatched.ep_recv_counts, expert_scales, comm.twin_key, num_experts
    )


MC2_DISPATCH = Kernel("moe_distribute_dispatch", npu=mc2_dispatch_npu, reference=mc2_dispatch_reference)
MC2_COMBINE = Kernel("moe_distribute_combine", npu=mc2_combine_npu, reference=mc2_combine_reference)


# --- the per-step choice ----------------------------------------------------------------------------------------


def mc2_tokens_capacity(max_num_seqs: int, num_speculative_tokens: int = 0) -> int:
    """Tokens per step up to which MC2 runs: a decode step's ``max_num_seqs * (1 + spec tokens)``, at most 512.

    MC2's buffers grow with its capacity (``global_bs * min(L, K)`` rows per rank, inside the HCCL window), so it is
    sized for decode steps; prefill-sized steps take the other dispatcher (vllm-ascend v0.11.0's rule).
    """
    return max(1, min(max_num_seqs * (1 + num_speculative_tokens), MC2_MAX_CAPACITY))


def mc2_candidate(setting: str, *, npu: bool, soc: str, ep_world: int) -> bool:
    """Whether MC2 may run at all for a layer (then per step: while the step's tokens fit the capacity).

    - ``off``: never. ``on``: always (on the emulated device its twin runs over gloo).
    - ``auto``: only on an NPU. On A3 MC2 beats the all-to-all at decode sizes; on A2 it pays off only from 16
      expert-parallel ranks (across machines), below that the all-gather path is faster (vllm-ascend v0.11.0's
      ``_select_moe_comm_method``, from their measurements). Other chips (310P) have no MC2 kernels. The emulated
      device keeps its other dispatchers (the twin exists to check MC2, not to speed anything up).
    """
    if setting == "off":
        return False
    if setting == "on":
        return True
    if setting != "auto":
        raise ConfigError(f"npu.moe_mc2={setting!r} is invalid; allowed: 'auto', 'on', 'off'")
    if not npu:
        return False
    return soc == "A3" or (soc == "A2" and ep_world >= 16)


class QuantizedRowsExperts(Protocol):
    """An :data:`ExpertsFn` that also takes rows already quantised per token (MC2's dynamic-quant mode)."""

    def __call__(self, rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor: ...

    def run_int8(
        self, rows: torch.Tensor, scales: torch.Tensor, group_counts: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor: ...


@dataclass
class MC2Dispatcher:
    """Route through MC2 (see the module docstring). ``max_tokens_per_rank`` is the capacity each rank may send."""

    placement: ExpertPlacement
    rank: int
    comm: MC2Comm
    dispatch: MC2DispatchFn
    combine: MC2CombineFn
    max_tokens_per_rank: int
    replicated_tokens: bool

    def __post_init__(self) -> None:
        if self.placement.world != self.comm.world or not self.placement.uniform:
            raise ConfigError(
                f"MC2 needs the experts spread evenly over the {self.comm.world} expert-parallel ranks; this "
                f"placement holds {self.placement.local_counts} per rank: use npu.moe_mc2='off' or an even placement"
            )
        self.global_bs = self.max_tokens_per_rank * self.comm.world

    def token_slice(self, num_tokens: int) -> tuple[int, int]:
        """This rank's tokens: all of them, or its even share when every rank holds the same tokens."""
        if not self.replicated_tokens:
            return 0, num_tokens
        share = -(-num_tokens // self.comm.world)
        lo = min(self.rank * share, num_tokens)
        return lo, min(lo + share, num_tokens)

    def tokens_per_rank(self, num_tokens: int) -> int:
        """The tokens a rank sends for a step of ``num_tokens`` (per-rank, for the capacity check)."""
        return -(-num_tokens // self.comm.world) if self.replicated_tokens else num_tokens

    def __call__(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertsFn
    ) -> torch.Tensor:
        num_tokens, width = hidden.shape
        lo, hi = self.token_slice(num_tokens)
        if hi - lo > self.max_tokens_per_rank:
            raise ValueError(
                f"MC2: {hi - lo} tokens on rank {self.rank} exceed its capacity {self.max_tokens_per_rank}"
            )
        placement = self.placement.to(hidden.device)
        x, weights = hidden[lo:hi], topk_weights[lo:hi]
        physical = placement.choose(topk_ids[lo:hi], offset=lo if self.replicated_tokens else self.rank)
        placement.record_ids(physical)  # this rank's token share (before the empty step's stand-in row)
        empty = x.shape[0] == 0
        if empty:
            # The kernels' batch starts at 1: send one zero-weight row to distinct experts and drop its output.
            k = topk_ids.shape[1]
            x = hidden.new_zeros(1, width)
            weights = topk_weights.new_zeros(1, k)
            physical = (torch.arange(k, device=hidden.device) % placement.num_physical).unsqueeze(0)
        quant = callable(getattr(experts, "run_int8", None))
        d = self.dispatch(x, physical, self.comm, placement.num_physical, self.global_bs, quant)
        counts = d.expert_token_nums
        if in_graph_step():
            # Traced into a compiled (torchair) graph or captured into an ACL graph: no host read of the received row
            # count. The experts get the
            # whole buffer (the MC2 capacity, a static shape) with the kernel's counts as the grouped matmul's
            # group list; rows past the counts come out undefined and the combine reads only the counted ones
            # (vllm-ascend v0.11.0's torchair MC2, torchair_fused_moe.py: expand_x and expert_token_nums passed on).
            if quant:
                expert_out = experts.run_int8(d.expand_x, d.dynamic_scales, counts, hidden.dtype)  # type: ignore[attr-defined]
            else:
                expert_out = experts(d.expand_x, counts)
            return self._finish(hidden, expert_out, physical, d, weights, placement, empty, lo, hi)
        n = int(counts.sum())
        if n == 0:
            done = d.expand_x.new_zeros((0, width), dtype=hidden.dtype)
        elif quant:
            done = experts.run_int8(d.expand_x[:n], d.dynamic_scales[:n], counts, hidden.dtype)  # type: ignore[attr-defined]
        else:
            done = experts(d.expand_x[:n], counts)
        expert_out = done.new_zeros((d.expand_x.shape[0], width))
        expert_out[:n] = done
        return self._finish(hidden, expert_out, physical, d, weights, placement, empty, lo, hi)

    def _finish(
        self,
        hidden: torch.Tensor,
        expert_out: torch.Tensor,
        physical: torch.Tensor,
        d: MC2Dispatch,
        weights: torch.Tensor,
        placement: ExpertPlacement,
        empty: bool,
        lo: int,
        hi: int,
    ) -> torch.Tensor:
        """Combine, then place this rank's rows: its own tokens, or its share in an otherwise-zero [T, H]."""
        out = self.combine(expert_out, physical, d, weights, self.comm, placement.num_physical, self.global_bs)
        out = out[:0] if empty else out
        if not self.replicated_tokens:
            return out.to(hidden.dtype)
        if lo == 0 and hi == hidden.shape[0]:
            return out.to(hidden.dtype)
        # zero rows around the share: a concatenation (in a graph: no scatter into a zero buffer)
        before, after = hidden.new_zeros(lo, hidden.shape[1]), hidden.new_zeros(hidden.shape[0] - hi, hidden.shape[1])
        return torch.cat((before, out.to(hidden.dtype), after))


@dataclass
class StepDispatcher:
    """MC2 while the step fits its capacity, ``other`` beyond (both must give the same result contract).

    ``step_tokens(hidden)`` is the step's token count, equal on every rank of the group (the largest DP rank's
    count under data-parallel attention), so all ranks take the same collective. ``calls`` counts the choices.
    """

    mc2: MC2Dispatcher
    other: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertsFn], torch.Tensor]
    capacity: int
    step_tokens: Callable[[torch.Tensor], int] = field(default=lambda hidden: int(hidden.shape[0]))
    calls: dict[str, int] = field(default_factory=lambda: {"mc2": 0, "other": 0})

    def uses_mc2(self, tokens: int) -> bool:
        return tokens <= self.capacity

    def __call__(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: ExpertsFn
    ) -> torch.Tensor:
        # Traced (torchair): the choice is made once, for the compiled size (a static shape), and the graph holds
        # only the chosen dispatcher; ``calls`` counts eager steps.
        traced = torch.compiler.is_compiling()
        if self.uses_mc2(self.step_tokens(hidden)):
            if not traced:
                self.calls["mc2"] += 1
            return self.mc2(hidden, topk_weights, topk_ids, experts)
        if not traced:
            self.calls["other"] += 1
        return self.other(hidden, topk_weights, topk_ids, experts)


def build_mc2(
    placement: ExpertPlacement,
    comm: MC2Comm,
    *,
    capacity: int,
    replicated_tokens: bool,
    backend: KernelBackend | None = None,
) -> MC2Dispatcher:
    """An :class:`MC2Dispatcher` for steps of up to ``capacity`` tokens, kernels chosen now."""
    per_rank = -(-capacity // comm.world) if replicated_tokens else capacity
    return MC2Dispatcher(
        placement,
        comm.rank,
        comm,
        MC2_DISPATCH.select(backend),
        MC2_COMBINE.select(backend),
        per_rank,
        replicated_tokens,
    )
