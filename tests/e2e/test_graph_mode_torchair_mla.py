# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.graph_mode='torchair'`` with a tiny DeepSeek-V3 (MLA, KV block 128) and the compile cache turned off.

In the torchair mode MLA attention stays vLLM's opaque op, one call inside the compiled decode graph (unlike GQA,
whose attention is traced into the graph; the backend's graph-capture support does not apply: the sparse backend's
NEVER would otherwise drop FULL_DECODE_ONLY to eager), so the MLA decode runs compiled. Greedy output must equal
HF's for batches of 1..5 (3 pads to 4, 5 is eager), with no compile after start-up and nothing written to the cache
directory.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

SIZES = [1, 2, 4]
BATCHES = range(1, SIZES[-1] + 2)
NEW_TOKENS = 6


def _stats():
    from vllm_npu.platform.graphs.torchair import TORCHAIR_STATS

    return TORCHAIR_STATS.snapshot()


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("deepseek_v3"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mla") / "torchair-cache"


@pytest.fixture(scope="module")
def llm(tiny_model, cache_dir, tmp_path_factory):
    npu = {"graph_mode": "torchair", "torchair_cache": False, "torchair_cache_dir": str(cache_dir)}
    env = emulated_env(tmp_path_factory.mktemp("torchair_mla"))
    kwargs = {"compilation_config": {"cudagraph_capture_sizes": SIZES}, "block_size": 128}
    with engine(tiny_model, env, additional_config={"npu": npu}, **kwargs) as llm:
        yield llm


def test_mla_decode_runs_compiled(llm):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["attention_backends"] == ["vllm_npu.attention.backends.mla.AscendMLABackend"]
    assert info["cudagraph_mode"] == "FULL_DECODE_ONLY"  # not dropped for MLA's graph support
    assert set(info["torchair"]["compiles"]) >= set(SIZES) and info["torchair"]["compiled_calls"], info["torchair"]
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    assert type(model).__name__ == "TorchairWrapper" and sorted(model.compiled) == SIZES
    assert model.compile_counts == dict.fromkeys(SIZES, 1)
    # Attention is the opaque op in every compiled graph: one node per layer per size (counts are per process).
    from vllm.attention.layer import Attention

    layers = [m for m in model.unwrap().modules() if isinstance(m, Attention)]
    assert layers and not any(m.use_direct_call for m in layers)
    assert info["torchair"]["opaque_attention_nodes"] >= len(layers) * len(SIZES), info["torchair"]


def test_greedy_matches_hf_with_zero_recompiles(llm, tiny_model, cache_dir):
    prompts = make_prompts([3 + (7 * i) % 13 for i in BATCHES], seed=11)
    before = _stats()
    outputs = {n: greedy(llm, prompts[:n], NEW_TOKENS) for n in BATCHES}
    after = _stats()
    reference = hf_greedy(tiny_model, prompts, NEW_TOKENS)
    for n in BATCHES:
        assert outputs[n] == reference[:n], f"batch of {n}"
    assert after["compiles"] == before["compiles"] and after["recompiles"] == before["recompiles"]
    assert all(after["compiled_calls"][n] > before["compiled_calls"].get(n, 0) for n in SIZES), after
    assert after["cache_hits"] == before["cache_hits"] and after["cache_writes"] == before["cache_writes"]
    assert not cache_dir.exists()  # npu.torchair_cache=false: nothing cached
