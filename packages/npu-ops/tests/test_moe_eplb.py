# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Dynamic EPLB in npu-ops: expert load counting and following vLLM's EplbState tables.

- Load counts of every dispatcher (local over replicated tokens on 2 ranks, all-to-all, MC2 twin) == the brute-force
  count of the routing (a Python loop over (token, slot) pairs and vLLM's replica rule), and per logical expert ==
  the bincount of the router's top-k; outputs == the MoE without any placement.
- Rearrangement on 2 gloo ranks (moe_eplb_worker.py): vLLM's rebalance + weight exchange with the same plan
  re-run: the map changed, each slot holds its new logical expert's weights, and the layer output is unchanged.
- Bad input: the EPLB split and the combinations EPLB refuses, with the key named.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm_npu.interface import ConfigError
from vllm_npu.ops.moe.eplb import check_eplb_layer, eplb_placement, eplb_tables
from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
from vllm_npu.ops.moe.gating import RoutingConfig
from vllm_npu.ops.moe.mc2 import MC2Comm

WORKER = Path(__file__).with_name("moe_eplb_worker.py")
E, R, K, HID, INTER = 6, 2, 2, 16, 8


def _inputs(tokens: int = 37, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, HID, generator=gen) / HID**0.5
    w2 = torch.randn(E, HID, INTER, generator=gen) / INTER**0.5
    x = torch.randn(tokens, HID, generator=gen)
    logits = torch.randn(tokens, E, generator=gen)
    logits[:, 4] += 1.5  # skewed: expert 4 is hot
    return w13, w2, x, logits


def _reference(w13, w2, x, logits):
    plan = build_moe_plan(RoutingConfig(top_k=K), E, act_dtype=torch.float32, backend="reference")
    return moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13, w2))


def _followed(world: int):
    """vLLM's initial EPLB placement for ``world`` ranks, following vLLM-shaped tables, with a zero load counter."""
    placement = eplb_placement(E, R, world)
    phys = placement.physical_to_logical.tolist()
    table, counts = eplb_tables(phys, E)
    placement.follow(table, counts, torch.zeros(len(phys), dtype=torch.int32))
    return placement, phys


def _plan(placement, rank: int, **extra):
    return build_moe_plan(
        RoutingConfig(top_k=K),
        E,
        act_dtype=torch.float32,
        placement=placement,
        ep_rank=rank,
        backend="reference",
        **extra,
    )


def _brute_force_counts(topk_ids: torch.Tensor, phys: list[int], offset: int = 0) -> list[int]:
    """Rows per physical expert: slot j of token t goes to replica (t + offset) % n of its logical expert."""
    out = [0] * len(phys)
    for t, row in enumerate(topk_ids.tolist()):
        for e in row:
            replicas = [p for p, lg in enumerate(phys) if lg == e]
            out[replicas[(t + offset) % len(replicas)]] += 1
    return out


def _logical(counts: list[int], phys: list[int]) -> list[int]:
    out = [0] * E
    for p, n in enumerate(counts):
        out[phys[p]] += n
    return out


def test_initial_placement_is_vllms():
    placement = eplb_placement(E, R, 2)
    assert placement.slots == [[0, 1, 2, 3], [4, 5, 0, 1]]  # EplbState.build_initial_global_physical_to_logical_map
    assert (placement.num_logical, placement.num_physical, placement.local_counts) == (6, 8, [4, 4])


def test_local_dispatcher_counts_each_pair_once_over_two_ranks():
    w13, w2, x, logits = _inputs()
    topk_ids = torch.topk(logits, K, dim=-1).indices  # softmax is monotonic: the router's top-k
    total, out = [0] * (E + R), torch.zeros_like(x)
    for rank in range(2):
        placement, phys = _followed(2)
        plan = _plan(placement, rank)
        mine = placement.slots[rank]
        out += moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13[mine], w2[mine]))
        counts = placement.load.tolist()
        lo, hi = placement.offsets[rank], placement.offsets[rank] + placement.local_counts[rank]
        assert all(n == 0 for p, n in enumerate(counts) if not lo <= p < hi)  # only its own slots
        total = [a + b for a, b in zip(total, counts, strict=True)]
    assert total == _brute_force_counts(topk_ids, phys)
    assert _logical(total, phys) == torch.bincount(topk_ids.flatten(), minlength=E).tolist()
    torch.testing.assert_close(out, _reference(w13, w2, x, logits), atol=1e-5, rtol=1e-5)


def _ident(x, out_splits, in_splits):
    return x


@pytest.mark.parametrize("path", ["all_to_all", "mc2"])
def test_exchange_dispatchers_count_their_tokens(path):
    w13, w2, x, logits = _inputs(tokens=23, seed=5)
    topk_ids = torch.topk(logits, K, dim=-1).indices
    placement, phys = _followed(1)  # one rank holds all 8 slots (experts 0 and 1 twice)
    extra = {"all_to_all": _ident} if path == "all_to_all" else {"mc2": MC2Comm(0, 1, _ident), "mc2_capacity": 64}
    plan = _plan(placement, 0, **extra)
    out = moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13[phys], w2[phys]))
    if path == "mc2":
        assert plan.dispatcher.calls["mc2"] == 1
    assert placement.load.tolist() == _brute_force_counts(topk_ids, phys)
    assert _logical(placement.load.tolist(), phys) == torch.bincount(topk_ids.flatten(), minlength=E).tolist()
    torch.testing.assert_close(out, _reference(w13, w2, x, logits), atol=1e-5, rtol=1e-5)


def test_followed_tables_steer_the_same_plan():
    """An in-place table update (what EplbState.rearrange does) reroutes without rebuilding the plan."""
    w13, w2, x, logits = _inputs(tokens=11)
    placement, phys = _followed(1)
    plan = _plan(placement, 0, all_to_all=_ident)
    # Slot 7 now holds expert 4 (was 1): expert 4 gets two replicas, expert 1 one.
    phys[7] = 4
    placement.replica_table[1, 1] = -1
    placement.replica_table[4, 1] = 7
    placement.replica_counts[1], placement.replica_counts[4] = 1, 2
    out = moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13[phys], w2[phys]))
    assert placement.load[7] > 0 and placement.load.tolist() == _brute_force_counts(
        torch.topk(logits, K, dim=-1).indices, phys
    )
    torch.testing.assert_close(out, _reference(w13, w2, x, logits), atol=1e-5, rtol=1e-5)


def test_rearrangement_on_two_gloo_ranks_keeps_the_output(tmp_path):
    init = f"file://{tmp_path}/pg"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_NPU_DEVICE": "emulated"}
    files = [tmp_path / f"rank{r}.pt" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", init, str(files[r])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    got = [torch.load(f) for f in files]
    initial, new = got[0]["initial"], got[0]["new"]
    assert new == got[1]["new"] and new != initial
    hot = 5
    assert new.count(hot) > initial.count(hot)  # the hot expert got a redundant replica
    assert sorted(set(new)) == list(range(E))
    per_rank = len(new) // 2
    for rank, g in enumerate(got):
        for slot in range(per_rank):
            e = new[rank * per_rank + slot]
            assert torch.equal(g["w13"][slot], g["w13_log"][e]) and torch.equal(g["w2"][slot], g["w2_log"][e])
        torch.testing.assert_close(g["after"], g["before"], atol=1e-5, rtol=1e-5)
    assert sum(got[0]["load_total"].tolist()) == 40 * K  # all-reduced load: each (token, slot) pair once


def test_uneven_physical_split_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="num_redundant_experts=1"):
        eplb_placement(E, 1, 2, layer_name="model.layers.0.mlp.experts")


def test_static_map_with_eplb_is_refused_naming_both_keys():
    from vllm.model_executor.layers.fused_moe.layer import UnquantizedFusedMoEMethod

    layer = SimpleNamespace(layer_name="model.layers.0.mlp.experts", quant_method=object())
    with pytest.raises(ConfigError, match=r"npu\.expert_map_path.*--enable-eplb"):
        check_eplb_layer(layer, expert_map_path="/tmp/map.json")
    with pytest.raises(ConfigError, match="--enable-eplb needs a MoE method whose expert tensors .* object"):
        check_eplb_layer(layer, expert_map_path=None)
    layer.quant_method = SimpleNamespace(moves_with_eplb=True)  # declares EplbMovableExperts (npu-quant's methods)
    check_eplb_layer(layer, expert_map_path=None)
    layer.quant_method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    check_eplb_layer(layer, expert_map_path=None)  # float experts, no static map: accepted
