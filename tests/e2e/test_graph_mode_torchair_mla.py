# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.graph_mode='torchair'`` with a tiny DeepSeek-V3 (MLA, KV block 128) and the compile cache turned off.

MLA attention is inside the compiled decode graph, as GQA's is (``test_graph_mode_torchair``): the platform answers
``opaque_attention_op()`` False, vLLM's layers call the MLA impl directly, and each compiled step hands the impl its
block table, lengths and latent-cache slots as graph inputs (``AscendMLAMetadata.graph_inputs``), on which it writes
the latent cache and runs the absorbed decode. Greedy output must equal HF's for batches of 1..5 (3 pads to 4, 5 is
eager), with no compile after start-up, no opaque attention node in any compiled graph, one metadata object laid out
per compiled step, nothing written to the cache directory; and decode steps run on stale graph inputs must give
wrong tokens (the graph really reads them). The backend's graph-capture support does not apply in this mode
(FULL_DECODE_ONLY is kept).
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
from npu_testkit.graph_e2e import stale_graph_outputs, stats_delta, torchair_stats
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

SIZES = [1, 2, 4]
BATCHES = range(1, SIZES[-1] + 2)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("deepseek_v3"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mla") / "torchair-cache"


@pytest.fixture(scope="module")
def started(tiny_model, cache_dir, tmp_path_factory):
    """The engine, and what its start-up added to the process's torchair counts."""
    npu = {"graph_mode": "torchair", "torchair_cache": False, "torchair_cache_dir": str(cache_dir)}
    env = emulated_env(tmp_path_factory.mktemp("torchair_mla"))
    kwargs = {"compilation_config": {"cudagraph_capture_sizes": SIZES}, "block_size": 128}
    before = torchair_stats()
    with engine(tiny_model, env, additional_config={"npu": npu}, **kwargs) as llm:
        yield llm, stats_delta(before, torchair_stats())


@pytest.fixture(scope="module")
def prompts():
    return make_prompts([3 + (7 * i) % 13 for i in BATCHES], seed=11)


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    return hf_greedy(tiny_model, prompts, NEW_TOKENS)


def test_mla_attention_is_compiled_into_the_graph(started):
    from vllm.attention.layer import Attention

    llm, startup = started
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["attention_backends"] == ["vllm_npu.attention.backends.mla.AscendMLABackend"]
    assert info["cudagraph_mode"] == "FULL_DECODE_ONLY"  # not dropped for MLA's graph support
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    assert type(model).__name__ == "TorchairWrapper" and sorted(model.compiled) == SIZES
    assert model.compile_counts == dict.fromkeys(SIZES, 1) and startup["compiles"] == dict.fromkeys(SIZES, 1)
    layers = [m for m in model.unwrap().modules() if isinstance(m, Attention)]
    assert layers and all(m.use_direct_call for m in layers)  # opaque_attention_op() answered False: traced
    assert startup["opaque_attention_nodes"] == 0, startup
    assert startup["graph_inputs_prepared"] == len(SIZES)  # one KV-cache group: one metadata object per size


def test_greedy_matches_hf_with_zero_recompiles(started, prompts, reference, cache_dir):
    llm, _ = started
    before = torchair_stats()
    outputs = {n: greedy(llm, prompts[:n], NEW_TOKENS) for n in BATCHES}
    serving = stats_delta(before, torchair_stats())
    for n in BATCHES:
        assert outputs[n] == reference[:n], f"batch of {n}"
    assert serving["compiles"] == {} and serving["recompiles"] == 0, serving
    assert set(serving["compiled_calls"]) == set(SIZES) and serving["eager_calls"] > 0, serving
    assert serving["graph_inputs_prepared"] == sum(serving["compiled_calls"].values()), serving
    assert serving["cache_hits"] == serving["cache_writes"] == 0 and not cache_dir.exists()  # cache off


def test_stale_graph_inputs_give_wrong_tokens(started, prompts, reference):
    from vllm_npu.attention.backends.mla import AscendMLAMetadata

    llm, _ = started
    n = SIZES[-1]
    before = torchair_stats()
    stale = stale_graph_outputs(llm, prompts[:n], NEW_TOKENS, AscendMLAMetadata)
    assert stale != reference[:n]  # wrong tokens, no error ...
    assert all(s[0] == r[0] for s, r in zip(stale, reference[:n], strict=True))  # (the first is the eager prefill's)
    assert stats_delta(before, torchair_stats())["recompiles"] == 0  # ... and no recompile
    assert greedy(llm, prompts[:n], NEW_TOKENS) == reference[:n]  # fresh inputs again: right
