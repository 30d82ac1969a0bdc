# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.graph_mode='torchair'`` on the emulated device with a tiny Qwen2: the decode forward compiled per padded
batch size (``torch.compile(fullgraph=True, dynamic=False)`` with the stand-in backend), prefill and mixed steps
eager, and the compile cache across engine restarts.

Three engines run one after the other on one cache root (the fixture records what each did; the engines must not
overlap in one process):

- ``cold``: an empty cache. Every size is compiled once during start-up, its lowered graph written to the cache;
  batches of 1..5 requests (3 pads to 4, 5 runs eagerly) must equal HF's greedy output (what the eager engine
  produces, see ``test_qwen2_engine``) with zero compiles after start-up;
- ``warm``: the same key (same KV budget, so the same KV-cache shapes). Dynamo traces again (a new process would
  too), but every lowered graph is loaded from the cache instead of being lowered (cache hits, no lowering), and the
  loaded graphs produce the same tokens. Then sleep (level 1) and wake-up: wake-up gives the weights new addresses,
  which a ``frozen_parameter`` graph must not be called over (the stand-in refuses it, as the NPU graph would read
  freed memory), so every size is compiled again after wake-up (from the cache) and the tokens stay HF's;
- ``changed``: another KV budget (``VLLM_NPU_EMULATED_KV_CACHE_GB``, the emulated device's stand-in for what memory
  profiling gives on an NPU; ``gpu_memory_utilization`` does not size the emulated KV cache, and
  ``num_gpu_blocks_override`` / ``kv_cache_memory_bytes`` would bypass the worker's budget), so other KV-cache shapes
  and another key: a new directory, everything lowered again, nothing loaded. On an NPU torchair's ``cache_compile``
  reloads a cached graph without guards or shape checks, so the key is what keeps a graph of the old shapes away.
  Then, in the same engine, decode steps are run on *stale* graph inputs (each metadata object hands out the first
  patched step's inputs again): the tokens must go wrong, which proves the compiled graph really reads the per-step
  block tables, lengths and slots as inputs (and that nothing guards on them).

Attention is inside the compiled graph (vLLM's layers call the impl directly, no opaque attention op in Dynamo's
graphs), with each compiled step's metadata handed over as graph inputs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts
from npu_testkit.graph_e2e import stale_graph_outputs, stats_delta, torchair_stats
from npu_testkit.models import hf_greedy

pytestmark = pytest.mark.engine

SIZES = [1, 2, 4]
BATCHES = range(1, SIZES[-1] + 2)
NEW_TOKENS = 6


def _run(
    model_dir, tmp_path, cache_root, prompts, *, kv_cache_gb: float, stale: bool = False, sleep: bool = False
) -> dict[str, Any]:
    from vllm.attention.layer import Attention
    from vllm_npu.attention.metadata import AscendMetadata

    before = torchair_stats()
    npu = {"graph_mode": "torchair", "torchair_cache_dir": str(cache_root)}
    kwargs = {"compilation_config": {"cudagraph_capture_sizes": SIZES}, "block_size": 16}
    env = emulated_env(tmp_path, kv_cache_gb=kv_cache_gb)
    with engine(model_dir, env, additional_config={"npu": npu}, **kwargs) as llm:
        started = torchair_stats()
        outputs = {n: greedy(llm, prompts[:n], NEW_TOKENS) for n in BATCHES}
        served = torchair_stats()
        woken = after_wake_up = None
        if sleep:
            llm.sleep(level=1)
            llm.wake_up()
            woken = torchair_stats()
            after_wake_up = greedy(llm, prompts[: SIZES[-1]], NEW_TOKENS)
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        directory = model.cache.directory
        direct = {m.use_direct_call for m in model.unwrap().modules() if isinstance(m, Attention)}
        stale_outputs = stale_graph_outputs(llm, prompts[: SIZES[-1]], NEW_TOKENS, AscendMetadata) if stale else None
    return {
        "direct_call": direct,
        "stale_outputs": stale_outputs,
        "startup": stats_delta(before, started),
        "serving": stats_delta(started, served),
        "outputs": outputs,
        "wake_up": None if woken is None else stats_delta(served, woken),
        "after_wake_up": after_wake_up,
        "wrapper": type(model).__name__,
        "directory": directory,
        "artifacts": sorted(p.name for p in directory.glob("bs*.pt")),
    }


@pytest.fixture(scope="module")
def runs(tiny_qwen2, tmp_path_factory):
    cache_root = tmp_path_factory.mktemp("torchair-cache")
    prompts = make_prompts([3 + (7 * i) % 13 for i in BATCHES], seed=11)
    result = {"reference": hf_greedy(tiny_qwen2, prompts, NEW_TOKENS)}
    for name, kv_cache_gb in (("cold", 0.0625), ("warm", 0.0625), ("changed", 0.03125)):
        tmp = tmp_path_factory.mktemp(name)
        result[name] = _run(
            tiny_qwen2, tmp, cache_root, prompts, kv_cache_gb=kv_cache_gb, stale=name == "changed", sleep=name == "warm"
        )
    return result


def test_every_decode_size_is_compiled_once_at_startup_and_cached(runs):
    cold = runs["cold"]
    assert cold["wrapper"] == "TorchairWrapper"
    assert cold["startup"]["compiles"] == dict.fromkeys(SIZES, 1)
    assert cold["startup"]["lowerings"] == len(SIZES) and cold["startup"]["cache_writes"] == len(SIZES)
    assert cold["startup"]["cache_hits"] == 0 and cold["startup"]["uncacheable"] == 0
    assert [name.split("-")[0] for name in cold["artifacts"]] == [f"bs{n}" for n in sorted(SIZES)]
    assert (cold["directory"] / "key.json").is_file()


@pytest.mark.parametrize("name", ["cold", "warm", "changed"])
def test_greedy_matches_hf_for_every_batch_size(runs, name):
    for n in BATCHES:
        assert runs[name]["outputs"][n] == runs["reference"][:n], f"{name}: batch of {n}"


@pytest.mark.parametrize("name", ["cold", "warm", "changed"])
def test_zero_recompiles_after_warm_up(runs, name):
    serving = runs[name]["serving"]
    assert serving["compiles"] == {} and serving["recompiles"] == 0 and serving["lowerings"] == 0, serving
    # Decode steps of every padded size ran compiled; prefill steps and the batch of 5 ran eagerly.
    assert set(serving["compiled_calls"]) == set(SIZES) and serving["eager_calls"] > 0, serving


def test_attention_is_compiled_into_the_graph_with_its_metadata_as_inputs(runs):
    cold = runs["cold"]
    assert cold["direct_call"] == {True}  # the platform answered opaque_attention_op() False: the impl is traced
    assert cold["startup"]["opaque_attention_nodes"] == 0
    # One KV-cache group: one metadata object laid out per compiled step (start-up compiles and serving steps).
    assert cold["startup"]["graph_inputs_prepared"] == len(SIZES)
    assert cold["serving"]["graph_inputs_prepared"] == sum(cold["serving"]["compiled_calls"].values()) > 0


def test_stale_graph_inputs_give_wrong_tokens(runs):
    changed = runs["changed"]
    n = SIZES[-1]
    assert changed["outputs"][n] == runs["reference"][:n]  # the same engine, fresh inputs: right
    assert changed["stale_outputs"] != runs["reference"][:n]  # stale inputs: wrong tokens, no error, no recompile


def test_second_engine_loads_every_graph_from_the_cache(runs):
    warm = runs["warm"]["startup"]
    assert runs["warm"]["directory"] == runs["cold"]["directory"]
    assert warm["compiles"] == dict.fromkeys(SIZES, 1)  # Dynamo traced again ...
    assert warm["cache_hits"] == len(SIZES) and warm["lowerings"] == 0 and warm["cache_writes"] == 0  # ... no lowering
    assert runs["warm"]["artifacts"] == runs["cold"]["artifacts"]


def test_wake_up_recompiles_every_size_from_the_cache_and_keeps_greedy_output(runs):
    warm = runs["warm"]
    # Every size compiled again after wake-up (the weights moved), each loaded from the cache, no guard failure.
    assert warm["wake_up"]["compiles"] == dict.fromkeys(SIZES, 1) and warm["wake_up"]["recompiles"] == 0
    assert warm["wake_up"]["cache_hits"] == len(SIZES) and warm["wake_up"]["lowerings"] == 0
    assert warm["after_wake_up"] == runs["reference"][: SIZES[-1]]


def test_another_kv_budget_is_another_key_and_invalidates_the_cache(runs):
    changed = runs["changed"]
    cold_key = json.loads((runs["cold"]["directory"] / "key.json").read_text())
    changed_key = json.loads((changed["directory"] / "key.json").read_text())
    # The same model, block size and software; only the KV caches' shapes (num_blocks) differ.
    assert {k: v for k, v in cold_key.items() if k != "kv_cache"} == {
        k: v for k, v in changed_key.items() if k != "kv_cache"
    }
    assert cold_key["kv_cache"] != changed_key["kv_cache"]
    assert changed["directory"] != runs["cold"]["directory"]
    assert changed["directory"].parent == runs["cold"]["directory"].parent
    assert changed["startup"]["cache_hits"] == 0 and changed["startup"]["lowerings"] == len(SIZES)
    assert len(changed["artifacts"]) == len(SIZES)


@pytest.mark.parametrize(
    ("npu", "extra", "match"),
    [
        (
            {"graph_mode": "torchair"},
            {"enforce_eager": True},
            r"npu.graph_mode='torchair' conflicts with enforce_eager",
        ),
        ({"graph_mode": "torchair", "torchair_dir": "/x"}, {}, r"npu.torchair_dir is not a known key"),
    ],
)
def test_bad_torchair_input_names_the_key(tiny_qwen2, tmp_path, npu, extra, match):
    with (
        pytest.raises(Exception, match=match),
        engine(tiny_qwen2, emulated_env(tmp_path), additional_config={"npu": npu}, **extra),
    ):
        pass
