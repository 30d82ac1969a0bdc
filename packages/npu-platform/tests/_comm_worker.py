# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Body of the two-rank NPUCommunicator test (run in spawned processes; not collected by pytest)."""

from __future__ import annotations

import os
import sys
import traceback


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["VLLM_NPU_DEVICE"] = "emulated"
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        group = dist.new_group(list(range(world)), backend="gloo")
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm_npu.platform.communicator import NPUCommunicator

        with set_current_vllm_config(VllmConfig()):
            comm = NPUCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name="tp:0")
        check(comm, rank, world)
        dist.barrier()
        dist.destroy_process_group()
        open(os.path.join(out_dir, f"rank{rank}.ok"), "w").close()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        sys.exit(1)


def rows(rank: int, n: int, width: int = 3, base: float = 0.0):
    """Rank-tagged rows: row i of rank r is [100r + i + base] * width."""
    import torch

    return (torch.arange(n, dtype=torch.float32)[:, None] + 100 * rank + base).repeat(1, width)


def check(comm, rank: int, world: int) -> None:
    import torch

    assert world == 2
    # all_reduce / all_gather / reduce_scatter (base-class calls on the gloo device group)
    x = torch.full((4,), float(rank + 1))
    assert torch.equal(comm.all_reduce(x.clone()), torch.full((4,), 3.0))
    g = comm.all_gather(torch.full((2, 3), float(rank)), dim=0)
    assert torch.equal(g, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)]))
    rs = comm.reduce_scatter(torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1), dim=0)
    assert torch.equal(rs, (torch.arange(8, dtype=torch.float32).reshape(4, 2) * 3)[2 * rank : 2 * rank + 2])

    # all_to_all, equal splits
    out = comm.all_to_all(rows(rank, 4))
    expect = torch.cat([rows(0, 4)[2 * rank : 2 * rank + 2], rows(1, 4)[2 * rank : 2 * rank + 2]])
    assert torch.equal(out, expect), (out, expect)

    # all_to_all, variable splits: rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 and 0.
    send = {0: [1, 3], 1: [2, 0]}
    x = rows(rank, sum(send[rank]))
    out = comm.all_to_all(x, input_split_sizes=send[rank])  # receive sizes exchanged on the CPU group
    parts = []
    for src in range(world):
        start = sum(send[src][:rank])
        parts.append(rows(src, sum(send[src]))[start : start + send[src][rank]])
    assert torch.equal(out, torch.cat(parts)), (rank, out)
    recv_sizes = [send[src][rank] for src in range(world)]
    assert torch.equal(comm.all_to_all(x, recv_sizes, send[rank]), out)
    assert comm.exchange_split_sizes(send[rank]) == recv_sizes
    # bf16 payloads (MoE hidden states)
    assert torch.equal(comm.all_to_all(x.bfloat16(), input_split_sizes=send[rank]), out.bfloat16())

    # all_gatherv / reduce_scatterv with uneven sizes
    sizes = [1, 3]
    gv = comm.all_gatherv(rows(rank, sizes[rank]), dim=0, sizes=sizes)
    assert torch.equal(gv, torch.cat([rows(0, 1), rows(1, 3)]))
    t = torch.arange(8, dtype=torch.float32).reshape(4, 2) + rank
    rsv = comm.reduce_scatterv(t, dim=0, sizes=sizes)
    full = torch.arange(8, dtype=torch.float32).reshape(4, 2) * 2 + 1
    assert torch.equal(rsv, full[:1] if rank == 0 else full[1:]), rsv

    # bad sizes are clear errors
    try:
        comm.all_to_all(x, input_split_sizes=[1])
    except ValueError as e:
        assert "need 2 non-negative sizes" in str(e)
    else:
        raise AssertionError("bad split sizes accepted")
