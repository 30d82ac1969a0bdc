# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""One data-parallel rank of an offline DP engine (run as a script by test_data_parallel_offline.py; not a test
module), the way vLLM runs offline data parallel: one process per DP rank, each with its own ``LLM``, told its rank
by ``VLLM_DP_RANK`` / ``VLLM_DP_RANK_LOCAL`` / ``VLLM_DP_SIZE`` / ``VLLM_DP_MASTER_IP`` / ``VLLM_DP_MASTER_PORT``.

Usage: python dp_rank.py <model dir> <request json> <output json>

The request JSON holds ``prompts`` (this rank's token prompts), ``max_tokens`` and ``llm`` (extra ``LLM`` keyword
arguments). The output JSON holds the greedy tokens per prompt and what the worker's parallel state says (DP rank
and size, EP size, the MoE layers' local expert count); with ``graph_state`` in the request (torchair mode) also
the torchair counts at start-up and what generating added, and the MoE layers' graph state.
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


def _torchair_stats() -> dict:
    from vllm_npu.platform.graphs.torchair import TORCHAIR_STATS

    return TORCHAIR_STATS.snapshot()


def _delta(before: dict, after: dict) -> dict:
    keys = ("recompiles", "opaque_moe_nodes", "opaque_attention_nodes", "eager_calls")
    out = {k: after[k] - before[k] for k in keys}
    out["compiles"] = sum(after["compiles"].values()) - sum(before["compiles"].values())
    out["compiled_calls"] = sum(after["compiled_calls"].values()) - sum(before["compiled_calls"].values())
    return out


def main() -> None:
    model, request_path, out_path = sys.argv[1:4]
    request = json.loads(Path(request_path).read_text())
    from npu_testkit.engine import make_llm, shutdown_llm, token_prompts
    from vllm import SamplingParams

    llm = make_llm(model, **request["llm"])
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    before = _torchair_stats()
    outs = llm.generate(token_prompts(request["prompts"]), params, use_tqdm=False)
    (state,) = llm.collective_rpc(_parallel_state)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], **state}
    if request.get("graph_state"):  # the torchair mode: its counts at start-up and during generate, the MoE layers
        (layers,) = llm.collective_rpc(_moe_layers)
        result.update(startup=before, generate=_delta(before, _torchair_stats()), moe_layers=layers)
    Path(out_path).write_text(json.dumps(result))
    shutdown_llm(llm)


if __name__ == "__main__":
    main()
