# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The KV pool on the Mooncake store, on the emulated device, everything on 127.0.0.1: a real ``mooncake_master``
and the memory-lending ``mooncake_client`` started by the test (``vllm_npu.kv.pool.launch``, what ``vllm-npu
kv-pool`` runs), tiny Qwen2 (GQA), float32, block size 16.

Instance A (configured the vllm-ascend way: ``MooncakeConnectorStoreV1`` + ``MOONCAKE_CONFIG_PATH``) serves long
prompts and stops. A fresh instance B (our name, ``MooncakeStoreConnector``, the keys inline) then serves them again:
most of each prompt comes from the pool (``num_cached_tokens``), and every answer == HF greedy, B decoding in
FULL_DECODE_ONLY graphs (the pool composes with graphs; A runs eager). Faults on B: a
corrupt pool object (another size) makes that load fail and the prompt is recomputed, == HF; the master killed
mid-run: new prompts are computed, == HF, nothing hangs; B's KV usage returns to zero (no leaked blocks).
"""

from __future__ import annotations

import json
import time

import pytest
from npu_testkit.engine import emulated_env, engine, greedy_outputs, make_prompts
from npu_testkit.graph_e2e import runtime_info
from npu_testkit.kv_pool import local_pool, store_config
from npu_testkit.models import hf_greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
BLOCK = 16
#: Long prompts (several blocks each, not all on a block boundary); a prompt to corrupt; prompts for a dead master.
LONG = [160, 203, 250, 301]
CORRUPT = [120]
DEAD = [90, 140]
SEED = "0"
#: Instance B decodes in full graphs (the pool composes with graphs): every batch size B decodes is captured.
B_GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}


def _store_config(master: str) -> dict[str, object]:
    return store_config(master, metadata_server="P2PHANDSHAKE", protocol="tcp", device_name="")


def _llm_kwargs(kv: dict[str, object]) -> dict[str, object]:
    return {"block_size": BLOCK, "enable_prefix_caching": True, "kv_transfer_config": kv}


def _block_keys(llm, prompt: list[int]) -> list[str]:
    """The pool keys of ``prompt``'s full blocks on TP rank 0, computed as vLLM hashes blocks."""
    from vllm.utils import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
    from vllm_npu.kv.pool.manager import block_key, namespace

    config = llm.llm_engine.vllm_config
    fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    ns = namespace(config)
    keys, parent = [], None
    for i in range(len(prompt) // BLOCK):
        parent = hash_block_tokens(fn, parent, prompt[i * BLOCK : (i + 1) * BLOCK])
        keys.append(block_key(ns, parent, "tp0"))
    return keys


def _kv_usage(llm) -> float:
    core = llm.llm_engine.engine_core.engine_core  # the in-process engine core
    return float(core.scheduler.kv_cache_manager.usage)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[list[int]]]:
    ps = make_prompts(LONG + CORRUPT + DEAD, seed=38)
    return {"long": ps[: len(LONG)], "corrupt": ps[len(LONG) : len(LONG) + 1], "dead": ps[len(LONG) + 1 :]}


@pytest.fixture(scope="module")
def references(tiny_qwen2, prompts) -> dict[str, list[list[int]]]:
    return {k: hf_greedy(tiny_qwen2, v, MAX_TOKENS) for k, v in prompts.items()}


@pytest.fixture(scope="module")
def runs(tiny_qwen2, prompts, tmp_path_factory) -> dict[str, object]:
    """A serves everything and stops; B serves the long prompts, the corrupted prompt, then (master killed) the rest."""
    tmp = tmp_path_factory.mktemp("kvpool")
    out: dict[str, object] = {}
    with local_pool(tmp, 256 << 20) as pool:
        from mooncake.store import MooncakeDistributedStore

        config_path = tmp / "mooncake.json"
        config_path.write_text(json.dumps(_store_config(pool.master_address)))
        env_a = emulated_env(tmp / "a", extra={"PYTHONHASHSEED": SEED, "MOONCAKE_CONFIG_PATH": str(config_path)})
        kv_a = {"kv_connector": "MooncakeConnectorStoreV1", "kv_role": "kv_both"}
        every = prompts["long"] + prompts["corrupt"] + prompts["dead"]
        start = time.perf_counter()
        with engine(tiny_qwen2, env_a, **_llm_kwargs(kv_a)) as llm:
            out["a"] = [list(o.outputs[0].token_ids) for o in greedy_outputs(llm, every, MAX_TOKENS)]
        out["a_seconds"] = time.perf_counter() - start

        # A wrong-size object under one block of the prompt to corrupt: the pool says it holds the block, its load
        # cannot fill the block (Mooncake returns -600), so the whole prompt is recomputed.
        client = MooncakeDistributedStore()
        assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", pool.master_address) == 0

        env_b = emulated_env(tmp / "b", extra={"PYTHONHASHSEED": SEED})
        kv_b = {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": _store_config(pool.master_address),
        }
        start = time.perf_counter()
        with engine(tiny_qwen2, env_b, **_llm_kwargs(kv_b), compilation_config=B_GRAPHS) as llm:
            outs = greedy_outputs(llm, prompts["long"], MAX_TOKENS)
            out["b_long"] = [list(o.outputs[0].token_ids) for o in outs]
            out["b_long_cached"] = [o.num_cached_tokens for o in outs]
            info = runtime_info(llm)
            out["b_graphs"] = (info["cudagraph_mode"], info["graphs"]["replays"].get("FULL", 0))

            keys = _block_keys(llm, prompts["corrupt"][0])
            out["corrupt_present"] = client.batch_is_exist(keys)
            victim = keys[2]
            assert client.remove(victim, True) == 0
            assert client.put(victim, b"x" * 100) == 0
            outs = greedy_outputs(llm, prompts["corrupt"], MAX_TOKENS)
            out["b_corrupt"] = [list(o.outputs[0].token_ids) for o in outs]
            out["b_corrupt_cached"] = [o.num_cached_tokens for o in outs]
            client.close()

            pool.master.kill()
            pool.master.wait()
            t0 = time.perf_counter()
            outs = greedy_outputs(llm, prompts["dead"], MAX_TOKENS)
            out["dead_seconds"] = time.perf_counter() - t0
            out["b_dead"] = [list(o.outputs[0].token_ids) for o in outs]
            out["b_dead_cached"] = [o.num_cached_tokens for o in outs]
            # vLLM reports a finished request's stores (and frees its blocks) at a later step: step until then.
            for _ in range(20):
                greedy_outputs(llm, [[5, 6, 7]], 1)
                if _kv_usage(llm) == 0.0:
                    break
                time.sleep(0.5)
            out["b_usage"] = _kv_usage(llm)
        out["b_seconds"] = time.perf_counter() - start
    print(f"\nkv pool engine: A {out.get('a_seconds', 0):.1f} s, B {out.get('b_seconds', 0):.1f} s", flush=True)
    return out


def test_instance_a_matches_hf(runs, references) -> None:
    assert runs["a"] == references["long"] + references["corrupt"] + references["dead"]


def test_fresh_instance_loads_most_of_each_prompt_from_the_pool(runs, prompts, references) -> None:
    assert runs["b_long"] == references["long"]
    mode, full_replays = runs["b_graphs"]
    assert mode == "FULL_DECODE_ONLY" and full_replays > 0  # B decoded them in full graphs
    for prompt, cached in zip(prompts["long"], runs["b_long_cached"]):
        full = len(prompt) // BLOCK * BLOCK
        # Every full block from the pool (a prompt on a block boundary recomputes its last token).
        assert cached >= min(full, len(prompt) - 1) - BLOCK + 1 and cached > 0.8 * len(prompt), (len(prompt), cached)


def test_corrupt_object_is_recomputed(runs, references) -> None:
    assert all(p == 1 for p in runs["corrupt_present"]), runs["corrupt_present"]
    assert runs["b_corrupt"] == references["corrupt"]
    assert runs["b_corrupt_cached"] == [0]  # the whole prompt computed here, nothing trusted from the pool


def test_master_killed_mid_run(runs, references) -> None:
    assert runs["b_dead"] == references["dead"]
    assert runs["b_dead_cached"] == [0, 0]
    assert runs["dead_seconds"] < 120  # no hang (the store answers at once with an error when the master is gone)


def test_no_leaked_blocks(runs) -> None:
    assert runs["b_usage"] == 0.0
