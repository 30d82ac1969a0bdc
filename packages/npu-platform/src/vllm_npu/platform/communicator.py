# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUCommunicator: the device communicator of every vLLM process group on the NPU platform.

vLLM builds each group's ``device_group`` with the platform's ``dist_backend``: HCCL on an NPU, gloo on the emulated
device, so one implementation serves both. Collectives operate on ``device_group`` with ``torch.distributed``
calls that both backends implement (``all_to_all_single``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce``); the variable-size ones that vLLM leaves unimplemented in its base class are built from them.

Contracts (``world`` = group size, ``r`` = this rank in the group; tensors on the group's device):

- ``all_reduce(x)``: sum over ranks, in place; returns ``x``.
- ``all_gather(x, dim)``: concatenation of every rank's ``x`` along ``dim`` (same shape on every rank).
- ``all_gatherv(x | [x...], dim=0, sizes)``: like ``all_gather`` along dim 0, rank ``i`` contributing ``sizes[i]``
  rows (``sizes=None``: equal sizes).
- ``reduce_scatter(x, dim)``: sum over ranks, then rank ``r`` keeps chunk ``r`` of ``dim`` (divisible by world).
- ``reduce_scatterv(x, dim=0, sizes)``: sum over ranks, rank ``r`` keeps ``sizes[r]`` rows at offset
  ``sum(sizes[:r])``.
- ``all_to_all(x, output_split_sizes, input_split_sizes)``: rank ``r`` sends rows
  ``x[sum(in[:j]) : sum(in[:j+1])]`` to rank ``j`` and receives ``out[j]`` rows from rank ``j``, concatenated in rank
  order (expert-parallel token dispatch/combine). ``None`` splits mean equal splits; when only
  ``input_split_sizes`` is given the receive sizes are exchanged first (on the CPU group, no device sync).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase


class NPUCommunicator(DeviceCommunicatorBase):
    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
    ) -> None:
        super().__init__(cpu_group, device, device_group, unique_name)
        if device_group is None:
            raise ValueError(f"NPUCommunicator {unique_name!r} needs a device process group")

    # all_reduce, all_gather, reduce_scatter, gather, send and recv: the base class's torch.distributed calls on
    # device_group work unchanged on HCCL and gloo.

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        if dim != 0:
            raise ValueError(f"all_gatherv gathers along dim 0 only, got dim={dim}")
        if isinstance(input_, (list, tuple)):
            return [self._all_gatherv_one(t, sizes) for t in input_]
        return self._all_gatherv_one(input_, sizes)

    def _all_gatherv_one(self, x: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if sizes is None:
            return self.all_gather(x, dim=0)
        self._check_sizes(sizes, x.shape[0], self.rank_in_group, "all_gatherv")
        # Pad every rank to the largest contribution, gather, then drop the padding.
        max_rows = max(sizes)
        padded = x.new_zeros((max_rows, *x.shape[1:]))
        padded[: x.shape[0]] = x
        gathered = torch.empty((self.world_size * max_rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(gathered, padded, group=self.device_group)
        return torch.cat([gathered[i * max_rows : i * max_rows + n] for i, n in enumerate(sizes)])

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
        if sizes is None:
            return self.reduce_scatter(input_, dim=dim)
        if self.world_size == 1:
            return input_
        if dim < 0:
            dim += input_.dim()
        self._check_sizes(sizes, None, None, "reduce_scatterv")
        if sum(sizes) != input_.shape[dim]:
            raise ValueError(
                f"reduce_scatterv: sizes {sizes} do not add up to dim {dim} of shape {tuple(input_.shape)}"
            )
        # Pad each rank's chunk to the largest, reduce_scatter the padded tensor, then drop the padding.
        x = input_.movedim(dim, 0)
        max_rows = max(sizes)
        padded = x.new_zeros((self.world_size * max_rows, *x.shape[1:]))
        offset = 0
        for i, n in enumerate(sizes):
            padded[i * max_rows : i * max_rows + n] = x[offset : offset + n]
            offset += n
        out = torch.empty((max_rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, padded, group=self.device_group)
        return out[: sizes[self.rank_in_group]].movedim(0, dim).contiguous()

    def all_to_all(
        self,
        input_: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """Exchange rows of ``input_`` (dim 0) between all ranks; see the module docstring for the contract."""
        if self.world_size == 1:
            if input_split_sizes is not None and list(input_split_sizes) != [input_.shape[0]]:
                raise ValueError(
                    f"all_to_all: input_split_sizes {input_split_sizes} do not cover {input_.shape[0]} rows"
                )
            return input_.clone()
        if input_split_sizes is None and output_split_sizes is not None:
            raise ValueError("all_to_all: output_split_sizes given without input_split_sizes")
        if input_split_sizes is not None:
            self._check_sizes(input_split_sizes, input_.shape[0], None, "all_to_all input")
            if output_split_sizes is None:
                output_split_sizes = self.exchange_split_sizes(input_split_sizes)
            self._check_sizes(output_split_sizes, None, None, "all_to_all output")
            out_rows = sum(output_split_sizes)
        else:
            if input_.shape[0] % self.world_size:
                raise ValueError(f"all_to_all: {input_.shape[0]} rows do not split evenly over {self.world_size} ranks")
            out_rows = input_.shape[0]
        x = input_.contiguous()
        out = torch.empty((out_rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(
            out,
            x,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=self.device_group,
        )
        return out

    def exchange_split_sizes(self, input_split_sizes: list[int]) -> list[int]:
        """Receive sizes of an all-to-all, given this rank's send sizes (one small host-side exchange)."""
        send = torch.tensor(list(input_split_sizes), dtype=torch.int64)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.cpu_group)
        return recv.tolist()

    def _check_sizes(self, sizes: list[int], rows: int | None, rank: int | None, what: str) -> None:
        if len(sizes) != self.world_size or any(n < 0 for n in sizes):
            raise ValueError(f"{what}: need {self.world_size} non-negative sizes, got {list(sizes)}")
        if rows is not None and rank is not None and sizes[rank] != rows:
            raise ValueError(f"{what}: this rank ({rank}) has {rows} rows but sizes[{rank}]={sizes[rank]}")
        if rows is not None and rank is None and sum(sizes) != rows:
            raise ValueError(f"{what}: sizes {list(sizes)} do not add up to {rows} rows")
