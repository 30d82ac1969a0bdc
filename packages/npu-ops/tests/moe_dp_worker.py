# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One rank of the DP x TP expert-parallel layer test (run as a script by test_moe_ep.py; not a test module).

Usage: python moe_dp_worker.py <rank> <world> <tp> <init_method> <out_dir>

Builds vLLM's parallel state for data_parallel_size = world / tp with enable_expert_parallel, constructs vLLM's
``FusedMoE`` (npu-ops' registered override, reduce_results=True), fills this rank's experts from the shared global
weights and runs its DP rank's tokens through the layer twice: with the layer's own plan (all-to-all through the EP
group's device communicator when TP is 1) and with a plan without all-to-all (as a quant method that does not run
``layer.moe_plan`` has: all-gather over DP, local experts, reduce-scatter, TP all-reduce). Saves both outputs and
what the layer chose to ``<out_dir>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys

import torch

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 7, 16, 8, 2
TOKENS = [6, 3]  # per DP rank


def inputs(dp_rank: int):
    gen = torch.Generator().manual_seed(77)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    gen_r = torch.Generator().manual_seed(500 + dp_rank)
    x = torch.randn(TOKENS[dp_rank], HIDDEN, generator=gen_r)
    return w13, w2, x, torch.randn(TOKENS[dp_rank], NUM_EXPERTS, generator=gen_r)


def replay_inputs(x: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The second step's tokens of a DP rank (replayed through the captured graph)."""
    return x * 0.5, logits.flip(-1)


def main() -> None:
    rank, world, tp, init, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dp = world // tp
    os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
    os.environ["RANK"] = str(rank)  # vLLM derives data_parallel_rank from it with the external launcher
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import get_ep_group
    from vllm.distributed import parallel_state as ps
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm_npu.ops._registry import register_oot_ops
    from vllm_npu.ops.moe.layer import build_layer_plan

    register_oot_ops()
    cfg = VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            enable_expert_parallel=True,
            distributed_executor_backend="external_launcher",
        )
    )
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(
            world_size=world, rank=rank, local_rank=rank, distributed_init_method=init, backend="gloo"
        )
        ps.initialize_model_parallel(tp, 1)
        layer = FusedMoE(
            num_experts=NUM_EXPERTS,
            top_k=TOP_K,
            hidden_size=HIDDEN,
            intermediate_size=INTER,
            params_dtype=torch.float32,
            renormalize=True,
            reduce_results=True,
            prefix="dp.experts",
        )
        all_to_all = layer.moe_plan.all_to_all
        own_plan = layer.moe_plan
        dp_rank = ps.get_dp_group().rank_in_group
        w13, w2, x, logits = inputs(dp_rank)
        emap = layer.expert_map
        local = (emap >= 0).nonzero().flatten()[emap[emap >= 0].argsort()]
        with torch.no_grad():
            layer.w13_weight.copy_(w13[local])
            layer.w2_weight.copy_(w2[local])
        layer.quant_method.process_weights_after_loading(layer)
        with set_forward_context(None, cfg), torch.no_grad():
            out = layer(x, logits)
        layer.moe_plan = build_layer_plan(layer, allow_all_to_all=False)
        with set_forward_context(None, cfg), torch.no_grad():
            out_gathered = layer(x, logits)
        gathered_plan = type(layer.moe_plan.dispatcher).__name__
        # Graphs on (no --enforce-eager): vLLM pads every DP rank's step to one size, the layer exchanges rows with
        # static shapes and runs inside a captured graph: the emulated twin's capture, as PIECEWISE captures it.
        from vllm_npu.ops.moe.capture import HostReadInCaptureError
        from vllm_npu.platform.graphs.emulated.twin import EmulatedGraph

        xp, lp = torch.zeros(max(TOKENS), HIDDEN), torch.zeros(max(TOKENS), NUM_EXPERTS)
        xp[: len(x)], lp[: len(x)] = x, logits
        layer._dp_padded = True
        layer.moe_plan = build_layer_plan(layer, dp_padded=True)
        graph_plan = type(layer.moe_plan.dispatcher).__name__
        with set_forward_context(None, cfg), torch.no_grad():
            graph = EmulatedGraph.capture(lambda a, b: layer(a, b), (xp, lp), {})
            out_graph = graph.output[: len(x)].clone()
            xp[: len(x)], lp[: len(x)] = replay_inputs(x, logits)  # the next step: new contents, same buffers
            out_replay = graph.replay((xp, lp), {})[: len(x)].clone()
        # vLLM's DP dummy batch (execute_dummy_batch -> _dummy_run(1), not captured) on DP rank 1 beside DP rank 0's
        # step: the forward context holds both ranks at the padded count, the layer gets one row.
        step = max(TOKENS)
        dummy = (x, logits) if dp_rank == 0 else (x[:1], logits[:1])
        counts = torch.tensor([step] * dp, dtype=torch.int32)
        with set_forward_context(None, cfg, num_tokens=step, num_tokens_across_dp=counts), torch.no_grad():
            out_dummy = layer(*dummy)
        # The layer's own plan without DP padding inside a capture (TP 1: the variable-size all-to-all; TP 2: the DP
        # gather sized by an exchange of token counts): refused on every rank alike.
        refused = ""
        layer._dp_padded, layer.moe_plan = False, own_plan
        try:
            with set_forward_context(None, cfg), torch.no_grad():
                EmulatedGraph.capture(lambda a, b: layer(a, b), (x, logits), {})
        except HostReadInCaptureError as error:
            refused = str(error)
        info = {
            "class": type(layer).__name__,
            "ep_size": layer.ep_size,
            "ep_rank": layer.ep_rank,
            "dp_size": layer.dp_size,
            "dp_rank": dp_rank,
            "all_to_all": all_to_all,
            "gathered_plan": gathered_plan,
            "communicator": type(get_ep_group().device_communicator).__name__,
            "local_experts": local.tolist(),
            "refused": refused,
        }
        info["graph_plan"] = graph_plan
        torch.save(
            {
                "out": out,
                "out_gathered": out_gathered,
                "out_graph": out_graph,
                "out_replay": out_replay,
                "out_dummy": out_dummy,
                "info": info,
            },
            f"{out_dir}/rank{rank}.pt",
        )
        torch.distributed.barrier()
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


if __name__ == "__main__":
    main()
