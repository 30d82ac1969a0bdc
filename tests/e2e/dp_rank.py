# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One data-parallel rank of an offline DP engine (run as a script by test_data_parallel_offline.py; not a test
module), the way vLLM runs offline data parallel: one process per DP rank, each with its own ``LLM``, told its rank
by ``VLLM_DP_RANK`` / ``VLLM_DP_RANK_LOCAL`` / ``VLLM_DP_SIZE`` / ``VLLM_DP_MASTER_IP`` / ``VLLM_DP_MASTER_PORT``.

Usage: python dp_rank.py <model dir> <request json> <output json>

The request JSON holds ``prompts`` (this rank's token prompts), ``max_tokens`` and ``llm`` (extra ``LLM`` keyword
arguments). The output JSON holds the greedy tokens per prompt and what the worker's parallel state says (DP rank
and size, EP size, the MoE layers' local expert count); with ``graph_state`` in the request (torchair mode) also
the torchair counts at start-up and what generating added, and the MoE layers' graph state. With ``enable_eplb``
in ``llm``: vLLM's EPLB state read back after generating (``npu_testkit.eplb.eplb_readback``). With ``late_prompts``
(possibly empty): a second generate after the first, its tokens, torchair counts and EPLB state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _parallel_state(worker) -> dict:
    from vllm.distributed.parallel_state import get_dp_group, get_ep_group

    experts = sorted(
        {m.local_num_experts for m in worker.model_runner.model.modules() if hasattr(m, "local_num_experts")}
    )
    return {
        "dp_rank": get_dp_group().rank_in_group,
        "dp_size": get_dp_group().world_size,
        "ep_size": get_ep_group().world_size,
        "local_experts": experts,
    }


def _moe_layers(worker) -> dict:
    from vllm_npu.ops.moe import AscendFusedMoE

    model = worker.model_runner.model
    layers = [m for m in model.unwrap().modules() if isinstance(m, AscendFusedMoE)]
    return {
        "wrapper": type(model).__name__,
        "compile_counts": {str(k): v for k, v in model.compile_counts.items()},
        "in_graph": [bool(m._moe_in_graph) for m in layers],
        "dispatchers": sorted({type(m.moe_plan.dispatcher).__name__ for m in layers}),
        "quant_methods": sorted({type(m.quant_method).__name__ for m in layers}),
    }


def _draft_moe_layers(worker) -> dict:
    """The MTP draft's MoE layers: their dispatcher and quant method, and the dispatch choices counted in eager
    passes (``StepDispatcher.calls``; compiled passes hold the exchange in the graph)."""
    from vllm_npu.ops.moe import AscendFusedMoE

    drafter = getattr(worker.model_runner, "drafter", None)
    if drafter is None:
        return {}
    model = drafter.model
    module = model.unwrap() if hasattr(model, "unwrap") else model
    layers = [m for m in module.modules() if isinstance(m, AscendFusedMoE)]
    calls: dict[str, int] = {}
    for m in layers:
        for key, n in getattr(m.moe_plan.dispatcher, "calls", {}).items():
            calls[key] = calls.get(key, 0) + n
    return {
        "wrapper": type(model).__name__,
        "layers": len(layers),
        "dispatchers": sorted({type(m.moe_plan.dispatcher).__name__ for m in layers}),
        "quant_methods": sorted({type(m.quant_method).__name__ for m in layers}),
        "calls": calls,
    }


def _torchair_stats(llm) -> dict:
    # read in the worker: with vLLM's engine-core process (multiprocessing) the counts live there, not here
    (info,) = llm.collective_rpc("npu_runtime_info")
    return info["torchair"]


def _count_acceptance(worker) -> None:
    """Count drafted and accepted draft tokens in the worker's rejection sampler (vLLM's spec-decode counters need
    its stat loggers, which its offline DP front end does not run: it asserts on the DP engines' stat-less outputs)."""
    sampler = getattr(worker.model_runner, "rejection_sampler", None)
    counts = worker.model_runner.test_spec_counts = {"drafted": 0, "accepted": 0}
    if sampler is None:
        return
    forward = sampler.forward

    def counted(metadata, *args, **kwargs):
        out = forward(metadata, *args, **kwargs)  # [requests, 1 + k], rejected slots hold -1
        counts["drafted"] += int(sum(metadata.num_draft_tokens))
        counts["accepted"] += int((out != -1).sum()) - out.shape[0]
        return out

    sampler.forward = counted


def _acceptance(worker) -> dict:
    return dict(worker.model_runner.test_spec_counts)


def _delta(before: dict, after: dict) -> dict:
    keys = ("recompiles", "opaque_moe_nodes", "opaque_attention_nodes", "eager_calls", "declined_steps")
    out = {k: after[k] - before[k] for k in keys}
    for key in ("compiles", "compiled_calls", "draft_compiled_calls"):
        out[key] = sum(after[key].values()) - sum(before[key].values())
    out["draft_compiles"] = after["draft_compiles"]  # the draft's sizes compile at their first pass while serving
    return out


def _late_phase(llm, request: dict, params) -> list[list[int]]:
    """Greedy tokens of ``late_prompts`` (a second ``generate`` after the first). A rank given none keeps stepping,
    as vLLM's offline DP front end steps a rank whose requests are done: a dummy batch for every step another DP rank
    takes (``LLMEngine.has_unfinished_requests``, all-reduced over the DP group, pairs with the other ranks')."""
    from npu_testkit.engine import token_prompts

    if request["late_prompts"]:
        outs = llm.generate(token_prompts(request["late_prompts"]), params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    engine = llm.llm_engine
    while engine.has_unfinished_requests():
        engine.step()
    return []


def main() -> None:
    model, request_path, out_path = sys.argv[1:4]
    request = json.loads(Path(request_path).read_text())
    from npu_testkit.engine import make_llm, shutdown_llm, token_prompts
    from npu_testkit.eplb import count_rearrangements, eplb_readback
    from vllm import SamplingParams

    llm = make_llm(model, **request["llm"])
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    graph_state = request.get("graph_state")
    eplb = request["llm"].get("enable_eplb", False)
    before = _torchair_stats(llm) if graph_state else {}
    llm.collective_rpc(_count_acceptance)
    if eplb:
        llm.collective_rpc(count_rearrangements)
    outs = llm.generate(token_prompts(request["prompts"]), params, use_tqdm=False)
    (state,) = llm.collective_rpc(_parallel_state)
    (spec,) = llm.collective_rpc(_acceptance)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], **state, "spec": spec}
    if graph_state:  # the torchair mode: its counts at start-up and during generate, the MoE layers
        (layers,) = llm.collective_rpc(_moe_layers)
        (result["draft_moe_layers"],) = llm.collective_rpc(_draft_moe_layers)
        result.update(startup=before, generate=_delta(before, _torchair_stats(llm)), moe_layers=layers)
    if eplb:  # vLLM's EPLB state after the first generate: maps, load, rearrangements, every slot checked
        (result["eplb"],) = llm.collective_rpc(eplb_readback)
    if "late_prompts" in request:
        late_before = _torchair_stats(llm) if graph_state else {}
        result["late_tokens"] = _late_phase(llm, request, params)
        if graph_state:
            result["late"] = _delta(late_before, _torchair_stats(llm))
        if eplb:
            (result["eplb_late"],) = llm.collective_rpc(eplb_readback)
    Path(out_path).write_text(json.dumps(result))
    shutdown_llm(llm)


if __name__ == "__main__":
    main()
