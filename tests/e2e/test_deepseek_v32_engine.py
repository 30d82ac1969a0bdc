# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device with a tiny DeepSeek-V3.2 (sparse attention + lightning indexer), float32.

One engine for the module: ``index_topk = 16``. A request whose sequence stays within 16 tokens has every causal
token selected, so its sparse attention must equal dense MLA: greedy output equals the same weights run as
DeepSeek-V3 (HF transformers; our MLA backend is checked against the same HF model in
``test_mla_deepseek_engine.py``). Longer requests attend to 16 tokens per layer: their output must equal an
independent sparse reference (HF DeepSeek-V3 with each layer's attention masked to a float64 brute-force indexer's
selection, ``deepseek_v32_support``), and the engine's own selection must equal that brute-force selection.

The engine is asked for FULL_DECODE_ONLY graphs, which the sparse backend does not support (``cudagraph_support
NEVER``, as vllm-ascend v0.11.0's SFA builder): vLLM downgrades it to eager and logs why (checked), so the rest runs
eagerly. The engine runs the normal NPUWorker with the default KV-cache dtype: NPUPlatform turns V3.2's "fp8_ds_mla" into the
model dtype, and NPUModelRunner binds the two cache layers of each decoder layer (latent cache and indexer keys).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, greedy_outputs, make_prompts, token_prompts
from npu_testkit.models import hf_greedy

pytestmark = pytest.mark.engine

_HERE = Path(__file__).resolve().parent
TOPK = 16
MAX_BATCHED_TOKENS = 64


def _load(name: str):
    """Import a helper module of this folder under its own name."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


support = _load("deepseek_v32_support")


@pytest.fixture(scope="module")
def checkpoints():
    return support.build_v32_pair(TOPK)


@pytest.fixture(scope="module")
def sparse_reference(checkpoints):
    v32, dense = checkpoints
    return support.SparseHFReference(dense, v32, TOPK)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def runner_warnings():
    """Warnings of vLLM's model runner while the module's engine starts (the graph-mode downgrade is one)."""
    return _Records()


@pytest.fixture(scope="module")
def llm(checkpoints, tmp_path_factory, runner_warnings):
    v32, _ = checkpoints
    env = emulated_env(tmp_path_factory.mktemp("deepseek_v32"))
    # FULL_DECODE_ONLY is asked for and refused by the sparse backend (cudagraph_support NEVER): vLLM downgrades the
    # engine to eager, so every check below runs eagerly, as without the request.
    graphs = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}
    log = logging.getLogger("vllm.v1.worker.gpu_model_runner")
    log.addHandler(runner_warnings)
    try:
        with engine(v32, env, max_num_batched_tokens=MAX_BATCHED_TOKENS, compilation_config=graphs) as llm:
            log.removeHandler(runner_warnings)
            yield llm
    finally:
        log.removeHandler(runner_warnings)


def test_full_decode_graphs_are_downgraded_to_eager_with_the_reason_logged(llm, runner_warnings):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["cudagraph_mode"] == "NONE"
    assert info["cudagraph_captured"] == 0 and info["graphs"]["captures"] == {}
    (reason,) = [m for m in runner_warnings.messages if "FULL_DECODE_ONLY is not supported" in m]
    assert "AscendSFAMetadataBuilder" in reason and "NEVER" in reason and "cudagraph_mode=NONE" in reason, reason


def _model_report(worker) -> dict:
    from vllm.model_executor.models.deepseek_v2 import Indexer
    from vllm_npu.attention import AscendSFAImpl, AscendSFAIndexerBackend
    from vllm_npu.models.deepseek_v32 import AscendDeepseekV32ForCausalLM, AscendIndexer, AscendIndexerKeyCache

    model = worker.model_runner.get_model()
    ctx = worker.vllm_config.compilation_config.static_forward_context
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        impl = attn.mla_attn.mla_attn.impl
        cache = ctx[f"{attn.indexer.prefix}.k_cache"]
        layers.append({
            "indexer": type(attn.indexer) is AscendIndexer,
            "shared": attn.mla_attn.indexer is attn.indexer and impl.indexer is attn.indexer,
            "impl": isinstance(impl, AscendSFAImpl),
            "cache_layer": type(cache) is AscendIndexerKeyCache and cache is attn.indexer.k_cache,
            "cache_backend": cache.get_attn_backend() is AscendSFAIndexerBackend,
            "cache_shape": tuple(cache.kv_cache[0].shape),
            "cache_dtype": str(cache.kv_cache[0].dtype),
            "buffer": (str(attn.indexer.topk_indices_buffer.device), tuple(attn.indexer.topk_indices_buffer.shape)),
        })  # fmt: skip
    return {
        "model": type(model) is AscendDeepseekV32ForCausalLM,
        "vllm_indexers_left": sum(isinstance(m, Indexer) for m in model.modules()),
        "same_buffer": len({id(layer.self_attn.indexer.topk_indices_buffer) for layer in model.model.layers}) == 1,
        "layers": layers,
    }


def test_override_and_sparse_backends_ran(llm):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["attention_backends"] == ["vllm_npu.attention.backends.sfa.AscendSFABackend"]
    assert info["attention_impls"] == ["vllm_npu.attention.backends.sfa.AscendSFAImpl"]
    assert info["kernel_backend"] == "reference"
    assert info["worker"] == "vllm_npu.platform.worker.NPUWorker"
    (report,) = llm.collective_rpc(_model_report)
    assert report["model"] and report["vllm_indexers_left"] == 0 and report["same_buffer"]
    block_size = info["block_size"]
    for layer in report["layers"]:
        assert (
            layer["indexer"] and layer["shared"] and layer["impl"] and layer["cache_layer"] and layer["cache_backend"]
        )
        assert layer["cache_shape"][1:] == (block_size, support.INDEX_HEAD_DIM)  # [blocks, block_size, index_head_dim]
        assert layer["cache_dtype"] == "torch.float32"  # the model dtype, not fp8
        assert layer["buffer"] == ("cpu", (MAX_BATCHED_TOKENS, TOPK))


def test_within_topk_equals_dense_and_beyond_matches_sparse_reference(llm, checkpoints, sparse_reference):
    # One batch: sequences of <= 16 tokens (1+8, 4+8, 8+8) are dense-equivalent; 40+8 and 90+8 are sparse, the
    # 90-token prompt prefilled in two chunks (its second chunk selects among cached indexer keys).
    _, dense = checkpoints
    prompts = make_prompts([1, 4, 8, 40, 90], seed=1)
    got = greedy(llm, prompts, 8)
    assert got[:3] == hf_greedy(dense, prompts[:3], 8)
    expected_sparse = sparse_reference.greedy(prompts[3:], 8)
    assert got[3:] == expected_sparse
    # The sparse path matters: dense attention continues the long prompts differently.
    dense_long = hf_greedy(dense, prompts[3:], 8)
    assert all(s != d for s, d in zip(expected_sparse, dense_long, strict=True)), (expected_sparse, dense_long)


def _topk_rows(worker, n: int) -> list[list[int]]:
    model = worker.model_runner.get_model()
    return model.model.layers[-1].self_attn.indexer.topk_indices_buffer[:n].tolist()


def test_engine_selection_equals_brute_force_indexer(llm, sparse_reference):
    # A single prefill step (max_tokens=1): the shared topk buffer then holds the last layer's selection of it.
    (prompt,) = make_prompts([50], seed=3)
    from vllm import SamplingParams

    llm.generate(token_prompts([prompt]), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    (rows,) = llm.collective_rpc(_topk_rows, args=(len(prompt),))
    sparse_reference.greedy([prompt], 1)
    expected = sparse_reference.selections[len(sparse_reference.model.model.layers) - 1]
    got = [{i for i in row if i >= 0} for row in rows]
    assert got == expected
    assert [len(s) for s in got] == [min(TOPK, t + 1) for t in range(len(prompt))]


def test_prefix_cache_hit_reuses_cached_indexer_keys(llm, sparse_reference):
    # The indexer keys live in the same paged blocks as the latent cache: a prefix-cache hit must bring back both.
    (prefix,) = make_prompts([48], seed=21)
    batch = [prefix + s for s in make_prompts([5, 20], seed=22)]
    expected = sparse_reference.greedy(batch, 6)

    assert greedy(llm, batch[:1], 6) == expected[:1]
    second = greedy_outputs(llm, batch, 6)
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    assert all(o.num_cached_tokens >= 48 for o in second), [o.num_cached_tokens for o in second]


def test_default_kv_cache_dtype_becomes_the_model_dtype(checkpoints, tmp_path):
    from npu_testkit.engine import patched_environ
    from vllm.engine.arg_utils import EngineArgs

    v32, _ = checkpoints
    with patched_environ(emulated_env(tmp_path)):
        config = EngineArgs(model=str(v32), dtype="float32", max_model_len=512).create_engine_config()
    assert config.cache_config.cache_dtype == "auto"
