# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Expert placement: which rank holds which expert, with redundant replicas, and the logical -> physical choice.

Logical experts are the model's (router columns, checkpoint names), ``0 .. E-1``. Physical experts are weight slots:
rank r holds ``len(slots[r])`` of them, numbered rank by rank (rank 0's slots first), so physical id
``offsets[r] + local`` is slot ``local`` of rank r and holds logical expert ``slots[r][local]``. A logical expert
held by several ranks has several replicas; a rank holds a logical expert at most once (its weight loader maps a
checkpoint expert to one local slot).

Replica choice (:meth:`ExpertPlacement.choose`): slot j of token t goes to replica ``(t + offset) % n_e`` of its
logical expert e (``n_e`` replicas, in rank order). It depends only on the token's position and a per-rank
``offset``, so ranks holding the same tokens (vLLM's default expert parallelism, offset 0) agree on every choice,
which a partial-sum-then-all-reduce combine needs; ranks holding different tokens pass their rank as the offset,
which spreads a hot expert's tokens over its replicas.

:func:`load_expert_map` reads the JSON placement of ``npu.expert_map_path`` (vllm-ascend's expert-map layout)::

    {"moe_layer_count": N,
     "layer_list": [{"layer_id": i, "device_count": W,
                     "device_list": [{"device_id": r, "device_expert": [logical ids of rank r's slots]}, ...]},
                    ...]}

``layer_id`` here is the decoder layer index of the MoE layer (``model.layers.<i>.``); for models whose every layer
is MoE (Qwen3-MoE, Qwen2-MoE) that is also vllm-ascend's MoE-layer ordinal.

Dynamic EPLB (vLLM's ``--enable-eplb``, :mod:`.eplb`): :meth:`ExpertPlacement.follow` makes the replica tables the
layer's views of vLLM's ``EplbState`` (updated in place when it rearranges the experts) and gives the placement a
load counter; every dispatcher calls :meth:`~ExpertPlacement.record_counts` / :meth:`~ExpertPlacement.record_ids`
with the rows it routes. ``slots`` then stays the initial placement: the slot structure (counts per rank, physical
numbering) never changes, only which logical expert a slot holds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from vllm_npu.interface import ConfigError


def static_table(table: torch.Tensor) -> torch.Tensor:
    """``table`` (a lookup table of fixed shape, not a module buffer) marked static for Dynamo: compiled with
    ``dynamic=True`` (the torchair mode on an NPU) a plain tensor attribute would get a symbolic size, which the GE
    graph would carry as a shape input. A no-op outside compilation."""
    torch._dynamo.mark_static(table)
    return table


class ExpertPlacement:
    """The placement of ``num_logical`` experts over ``len(slots)`` ranks (see the module docstring)."""

    def __init__(self, num_logical: int, slots: Sequence[Sequence[int]], *, one_per_rank: bool = True) -> None:
        """``one_per_rank=False`` lets a rank hold an expert twice (vLLM's EPLB placements, whose weight loading
        goes by physical id)."""
        self.num_logical = num_logical
        self.slots = [list(map(int, s)) for s in slots]
        self.world = len(self.slots)
        if self.world == 0:
            raise ConfigError("an expert placement needs at least one rank")
        for r, s in enumerate(self.slots):
            bad = [e for e in s if not 0 <= e < num_logical]
            if bad:
                raise ConfigError(f"expert placement: rank {r} lists experts {bad} outside 0..{num_logical - 1}")
            if one_per_rank and len(set(s)) != len(s):
                raise ConfigError(f"expert placement: rank {r} lists an expert twice ({s}); a rank holds one replica")
        held = {e for s in self.slots for e in s}
        missing = sorted(set(range(num_logical)) - held)
        if missing:
            raise ConfigError(f"expert placement: experts {missing} are on no rank; every expert needs a replica")
        self.local_counts = [len(s) for s in self.slots]
        self.num_physical = sum(self.local_counts)
        self.offsets = [sum(self.local_counts[:r]) for r in range(self.world)]
        physical_to_logical = torch.tensor([e for s in self.slots for e in s], dtype=torch.long)
        self.physical_to_logical = physical_to_logical
        replicas = [(physical_to_logical == e).nonzero().flatten() for e in range(num_logical)]
        self.replica_counts = static_table(torch.tensor([len(ids) for ids in replicas], dtype=torch.long))
        width = int(self.replica_counts.max())
        table = torch.zeros(num_logical, width, dtype=torch.long)
        for e, ids in enumerate(replicas):
            table[e, : len(ids)] = ids
        self.replica_table = static_table(table)
        self.num_redundant = self.num_physical - num_logical
        #: Rows routed to each physical expert ([num_physical] int32 on the device), or None: not counted.
        self.load: torch.Tensor | None = None
        self.live = False

    @classmethod
    def from_expert_maps(cls, expert_maps: Sequence[torch.Tensor]) -> ExpertPlacement:
        """The placement of vLLM's per-rank expert maps ([E] int: logical -> local slot, -1 elsewhere)."""
        slots = []
        for m in expert_maps:
            m = m.long().cpu()
            local = (m >= 0).nonzero().flatten()
            slots.append(local[m[local].argsort()].tolist())
        return cls(int(expert_maps[0].numel()), slots)

    def expert_map(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s map for weight loading: [E] int32, logical -> local slot, -1 where the rank has none."""
        m = torch.full((self.num_logical,), -1, dtype=torch.int32)
        m[torch.tensor(self.slots[rank], dtype=torch.long)] = torch.arange(len(self.slots[rank]), dtype=torch.int32)
        return m

    @property
    def uniform(self) -> bool:
        """Every rank holds the same number of slots (what the MC2 kernels need)."""
        return len(set(self.local_counts)) == 1

    def follow(
        self, logical_to_physical: torch.Tensor, replica_counts: torch.Tensor, load: torch.Tensor | None
    ) -> None:
        """Use vLLM's EPLB tables of this layer from now on (views; never copied, so rearrangements show).

        ``logical_to_physical`` [E, W] int64 (physical ids of each logical expert's replicas, -1 padded),
        ``replica_counts`` [E] int64, ``load`` [num_physical] int32 (EplbState's per-pass load of this layer).
        """
        num_physical = None if load is None else int(load.numel())
        if logical_to_physical.shape[0] != self.num_logical or num_physical not in (None, self.num_physical):
            raise ValueError(
                f"EPLB state for {tuple(logical_to_physical.shape)[0]} logical / {num_physical} physical experts; "
                f"this placement has {self.num_logical} / {self.num_physical}"
            )
        # Static shapes (the torchair mode on an NPU compiles with dynamic=True): graph inputs read per step, so a
        # rearrangement's in-place rewrite shows in the compiled graph without a recompile.
        self.replica_table, self.replica_counts = static_table(logical_to_physical), static_table(replica_counts)
        self.load = None if load is None else static_table(load)
        self.live = True

    def record_counts(self, counts: torch.Tensor, start: int = 0) -> None:
        """Add ``counts`` [n] (rows per physical expert ``start .. start+n-1``) to the load; on the device."""
        if self.load is not None:
            self.load[start : start + counts.numel()] += counts.to(self.load.dtype)

    def record_ids(self, physical: torch.Tensor) -> None:
        """Add one row per entry of ``physical`` (physical expert ids, any shape) to the load; on the device."""
        if self.load is not None:
            flat = physical.reshape(-1).long()
            self.load.index_add_(0, flat, torch.ones_like(flat, dtype=self.load.dtype))

    def to(self, device: torch.device) -> ExpertPlacement:
        """The lookup tables on ``device`` (once, when the layer first runs there)."""
        if self.live:
            if self.replica_table.device != device:
                raise RuntimeError(f"the EPLB state is on {self.replica_table.device}, the layer runs on {device}")
            return self
        if self.replica_table.device != device:
            self.replica_table = static_table(self.replica_table.to(device))
            self.replica_counts = static_table(self.replica_counts.to(device))
        return self

    def choose(self, topk_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Physical ids [T, k] int64 for logical ``topk_ids`` [T, k] (the replica rule of the module docstring)."""
        ids = topk_ids.long()
        if not self.live and self.num_redundant == 0 and int(self.replica_table.shape[1]) == 1:
            return self.replica_table[ids, 0]
        counts = self.replica_counts[ids]
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) + offset
        return self.replica_table[ids, token % counts]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExpertPlacement) and (self.num_logical, self.slots) == (
            other.num_logical,
            other.slots,
        )

    def __repr__(self) -> str:
        return f"ExpertPlacement(num_logical={self.num_logical}, slots={self.slots})"


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(prefix: str) -> int:
    """The decoder layer index in a module prefix (``model.layers.3.mlp.experts`` -> 3)."""
    match = _LAYER_INDEX.search(prefix)
    if match is None:
        raise ConfigError(f"npu.expert_map_path: cannot tell the decoder layer of MoE layer {prefix!r}")
    return int(match.group(1))


def load_expert_map(path: str | Path, *, layer: int, num_logical: int, world: int) -> ExpertPlacement:
    """Layer ``layer``'s placement from the JSON file at ``path``; ConfigError naming the problem and the file."""
    where = f"npu.expert_map_path={str(path)!r}"
    try:
        data: Any = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read the expert map ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: the expert map is not valid JSON ({exc})") from None
    layers = data.get("layer_list") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise ConfigError(f"{where}: the expert map needs a 'layer_list' list (see docs/moe.md)")
    entry = next((e for e in layers if isinstance(e, dict) and e.get("layer_id") == layer), None)
    if entry is None:
        raise ConfigError(f"{where}: no entry with layer_id {layer}; give every MoE layer a placement")
    devices = entry.get("device_list")
    if not isinstance(devices, list) or len(devices) != world:
        got = len(devices) if isinstance(devices, list) else "no"
        raise ConfigError(f"{where}: layer {layer} lists {got} devices; the expert-parallel group has {world} ranks")
    by_rank: dict[int, list[int]] = {}
    for d in devices:
        rank, experts = (d.get("device_id"), d.get("device_expert")) if isinstance(d, dict) else (None, None)
        if not isinstance(rank, int) or not isinstance(experts, list) or not all(isinstance(x, int) for x in experts):
            raise ConfigError(
                f"{where}: layer {layer}: each device needs an int 'device_id' and an int list 'device_expert'"
            )
        by_rank[rank] = experts
    if sorted(by_rank) != list(range(world)):
        raise ConfigError(f"{where}: layer {layer} has device ids {sorted(by_rank)}, expected 0..{world - 1}")
    try:
        return ExpertPlacement(num_logical, [by_rank[r] for r in range(world)])
    except ConfigError as exc:
        raise ConfigError(f"{where}: layer {layer}: {exc}") from None
