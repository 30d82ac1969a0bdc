# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vLLM's own ``OffloadingConnector`` (host-memory KV offload, ``num_cpu_blocks``) on the emulated device, through
npu-patches' ``host-offload-npu`` (vLLM's handler is CUDA-only). Tiny Qwen2 (GQA), float32, block size 16.

The device cache holds 40 blocks, too few for four 200-token prompts (13 blocks each) to stay: served one after the
other, the first prompt's blocks are evicted from the device (control: vLLM's device prefix cache no longer has its
first block) while the connector has copied them to host memory. Sent again, most of the first prompt comes back
from host memory (``num_cached_tokens``) and the answer == HF greedy.

Offload counters (npu-patches' ``host-offload-stats``): the offline ``LLM`` has no Prometheus logger (stats off), so
the test captures what each step's ``KVConnectorOutput.kv_connector_stats`` carries into the scheduler (the object
``SchedulerStats.kv_connector_stats`` is made of under ``vllm serve``) and reads it through ``kv-connector-metrics``'
own ``connector_stats`` + ``prometheus_counters()``: the four prompts stored blocks to host memory and loaded none;
the second run of the first prompt loaded exactly its cached tokens (the device held none of it) from host memory.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy_outputs, make_prompts
from npu_testkit.models import hf_greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
BLOCK = 16
LENGTHS = [200, 200, 200, 200]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=83)


@pytest.fixture(scope="module")
def references(tiny_qwen2, prompts) -> list[list[int]]:
    return hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)


def _on_device(llm, prompt: list[int]) -> bool:
    """Whether the device prefix cache still holds ``prompt``'s first block."""
    from vllm.utils import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    core = llm.llm_engine.engine_core.engine_core
    fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    first = hash_block_tokens(fn, None, prompt[:BLOCK])
    pool = core.scheduler.kv_cache_manager.block_pool
    return pool.get_cached_block(first, [0]) is not None


def _capture_connector_stats(llm) -> list[object]:
    """Every ``kv_connector_stats`` the worker hands the scheduler from now on (in step order)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    update = scheduler.update_from_output
    steps: list[object] = []

    def update_from_output(scheduler_output, model_runner_output):
        connector_output = model_runner_output.kv_connector_output
        if connector_output is not None and connector_output.kv_connector_stats is not None:
            steps.append(connector_output.kv_connector_stats)
        return update(scheduler_output, model_runner_output)

    scheduler.update_from_output = update_from_output
    return steps


def _counters(steps: list[object]) -> dict[str, float]:
    """The ``vllm:npu_kv_offload_*`` increments ``kv-connector-metrics`` would add for these steps' stats."""
    from vllm_npu.patches.sets.kv_connector_metrics import connector_stats

    totals: dict[str, float] = {}
    for stats in steps:
        for revived in connector_stats("OffloadingConnector", dict(stats.data)):  # type: ignore[attr-defined]
            for name, (_, increment) in revived.prometheus_counters().items():
                totals[name] = totals.get(name, 0) + increment
    return totals


@pytest.fixture(scope="module")
def run(tiny_qwen2, prompts, tmp_path_factory) -> dict[str, object]:
    env = emulated_env(tmp_path_factory.mktemp("offload"), extra={"PYTHONHASHSEED": "0"})
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": 128},
    }
    out: dict[str, object] = {}
    with engine(
        tiny_qwen2,
        env,
        block_size=BLOCK,
        enable_prefix_caching=True,
        num_gpu_blocks_override=40,
        max_num_seqs=2,
        kv_transfer_config=kv,
    ) as llm:
        steps = _capture_connector_stats(llm)
        out["first"] = [list(greedy_outputs(llm, [p], MAX_TOKENS)[0].outputs[0].token_ids) for p in prompts]
        out["evicted"] = not _on_device(llm, prompts[0])
        out["first_stats"], steps[:] = list(steps), []
        again = greedy_outputs(llm, [prompts[0]], MAX_TOKENS)[0]
        out["again"] = list(again.outputs[0].token_ids)
        out["again_cached"] = again.num_cached_tokens
        out["again_stats"] = list(steps)
    return out


def test_every_prompt_matches_hf(run, references) -> None:
    assert run["first"] == references


def test_first_prompt_comes_back_from_host_memory(run, references, prompts) -> None:
    assert run["evicted"], "control: the device cache should have evicted the first prompt"
    assert run["again"] == references[0]
    assert run["again_cached"] >= len(prompts[0]) // BLOCK * BLOCK - BLOCK, run["again_cached"]


def test_offload_counters(run, tiny_qwen2) -> None:
    from transformers import AutoConfig

    first, again = _counters(run["first_stats"]), _counters(run["again_stats"])
    # per device block: every layer's K and V planes of BLOCK tokens x KV heads x head size, float32
    cfg = AutoConfig.from_pretrained(tiny_qwen2)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = cfg.num_hidden_layers * 2 * BLOCK * cfg.num_key_value_heads * head * 4
    assert first["npu_kv_offload_loaded_blocks"] == 0, first  # four different prompts: no host hit
    stored = first["npu_kv_offload_stored_blocks"]
    # every prompt's full blocks went to host memory (the last one's may finish during the second run)
    full_blocks = sum(n // BLOCK for n in LENGTHS)
    assert (
        stored + again["npu_kv_offload_stored_blocks"] == full_blocks and stored >= full_blocks - LENGTHS[-1] // BLOCK
    )
    assert first["npu_kv_offload_stored_bytes"] == stored * block_bytes
    assert first["npu_kv_offload_stored_tokens"] == stored * BLOCK
    loaded = again["npu_kv_offload_loaded_blocks"]
    assert loaded * BLOCK == again["npu_kv_offload_loaded_tokens"] == run["again_cached"], (again, run["again_cached"])
    assert again["npu_kv_offload_loaded_bytes"] == loaded * block_bytes
