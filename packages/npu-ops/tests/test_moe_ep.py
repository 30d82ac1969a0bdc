# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Expert parallelism with the all-to-all dispatcher: EP=2 over gloo in two processes vs one process.

Each rank holds different tokens and half the experts (uneven split, linear and round-robin placement, a rank with
no tokens); its output must equal the single-process MoE on its own tokens with all experts (float32, 1e-5).
Runs once with ``torch.distributed.all_to_all_single`` and once through the platform's ``NPUCommunicator``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.long  # half a minute or more: scheduled with the engine modules (conftest.py)

WORKER = Path(__file__).with_name("moe_ep_worker.py")
DP_WORKER = Path(__file__).with_name("moe_dp_worker.py")


def _load_worker(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_ranks(worker: Path, argv: list[list[str]], env: dict[str, str], timeout: float) -> tuple[list[int], str]:
    """Start one ``worker`` process per argv (all at once: they rendezvous), wait for each (killed after
    ``timeout`` s); returns the exit codes and the joined output of every rank."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for args in argv
    ]
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        logs.append(out)
    return [p.returncode for p in procs], "\n".join(logs)


@pytest.mark.parametrize("comm", ["torch", "npu"])
def test_all_to_all_ep2_matches_single_process(tmp_path, comm):
    if comm == "npu" and importlib.util.find_spec("vllm_npu.platform.communicator") is None:
        pytest.fail("vllm_npu.platform.communicator is missing: install npu-platform")
    worker = _load_worker(WORKER)
    init = f"file://{tmp_path}/pg"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_NPU_DEVICE": "emulated"}
    codes, logs = _run_ranks(WORKER, [[str(r), "2", init, str(tmp_path), comm] for r in range(2)], env, 240)
    assert all(code == 0 for code in codes), logs

    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig

    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(got) == set(worker.SCENARIOS)
        for name, (num_experts, tokens, routing, _) in worker.SCENARIOS.items():
            w13, w2, bias, x, logits = worker.inputs(name, rank)
            plan = build_moe_plan(RoutingConfig(**routing), num_experts, act_dtype=torch.float32, backend="reference")
            expect = moe_forward(
                x,
                logits,
                plan=plan,
                experts=plan.unquantized_experts(w13, w2),
                e_score_correction_bias=bias if routing.get("has_correction_bias") else None,
            )
            assert got[name].shape == (tokens[rank], worker.HIDDEN)
            torch.testing.assert_close(got[name], expect, atol=1e-5, rtol=1e-5, msg=f"{name} rank {rank}")


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_moe_layer_dp2_matches_single_process(tmp_path, tp):
    """vLLM's FusedMoE (our override) with data_parallel_size=2 (x TP) + enable_expert_parallel, one process per
    rank. TP 1: the layer picks the all-to-all mode through NPUCommunicator (gloo); TP 2: all-gather over DP, local
    experts, reduce-scatter, TP all-reduce. Both modes run on every rank; each rank's output equals the
    single-process MoE over its DP rank's tokens with all 7 experts. Then with DP steps padded (graphs on): the
    static exchanges captured by the emulated twin give the same result and replay right on new contents, and the
    unpadded exchanges (TP 1: the all-to-all; TP 2: the DP gather sized on the host) fail their capture loudly. And
    vLLM's DP dummy batch on DP rank 1 (one row, the forward context's counts padded to rank 0's six) runs eagerly
    beside rank 0's step: the layer pads it to the count and gives each rank its own rows' output."""
    worker = _load_worker(DP_WORKER)
    world = 2 * tp
    init = f"file://{tmp_path}/pg"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_NPU_DEVICE": "emulated", "VLLM_NO_USAGE_STATS": "1"}
    argv = [[str(r), str(world), str(tp), init, str(tmp_path)] for r in range(world)]
    codes, logs = _run_ranks(DP_WORKER, argv, env, 600)
    assert all(code == 0 for code in codes), logs

    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig

    plan = build_moe_plan(
        RoutingConfig(top_k=worker.TOP_K), worker.NUM_EXPERTS, act_dtype=torch.float32, backend="reference"
    )
    placement = {2: [[0, 1, 2, 3], [4, 5, 6]], 4: [[0, 1], [2, 3], [4, 5], [6]]}[world]
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        dp_rank = rank // tp
        assert got["info"] == {
            "class": "AscendFusedMoE",
            "ep_size": world,
            "ep_rank": rank,
            "dp_size": 2,
            "dp_rank": dp_rank,
            "all_to_all": tp == 1,
            "gathered_plan": "LocalDispatcher",
            "communicator": "NPUCommunicator",
            "local_experts": placement[rank],
            # graphs on: static exchanges (all-gather / reduce-scatter over the EP group with TP 1, over DP with TP 2)
            "graph_plan": "GatheredDispatcher" if tp == 1 else "LocalDispatcher",
            "refused": got["info"]["refused"],
        }
        # unpadded exchanges inside a capture fail loudly: their sizes are read on the host
        what = "the all-to-all split sizes" if tp == 1 else "the DP ranks' token counts"
        assert f"read {what} on the host while a static graph" in got["info"]["refused"]
        w13, w2, x, logits = worker.inputs(dp_rank)
        experts = plan.unquantized_experts(w13, w2)
        expect = moe_forward(x, logits, plan=plan, experts=experts)
        torch.testing.assert_close(got["out"], expect, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["out_gathered"], expect, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["out_graph"], expect, atol=1e-5, rtol=1e-5)
        expect = moe_forward(*worker.replay_inputs(x, logits), plan=plan, experts=experts)
        torch.testing.assert_close(got["out_replay"], expect, atol=1e-5, rtol=1e-5)
        # DP rank 1's dummy batch (one row against the padded count [6, 6]) beside rank 0's step: padded in the
        # layer, each rank's own rows back
        rows = len(x) if dp_rank == 0 else 1
        expect = moe_forward(x[:rows], logits[:rows], plan=plan, experts=experts)
        torch.testing.assert_close(got["out_dummy"], expect, atol=1e-5, rtol=1e-5)
