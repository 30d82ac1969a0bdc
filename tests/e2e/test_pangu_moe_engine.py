# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""PanguProMoEForCausalLM (npu-models; vLLM 0.11 has no class for it) in a real vLLM engine on the emulated device,
TP=1, float32, in the NPU's default graph mode (``cudagraph_mode=PIECEWISE``, capture sizes 1/2/4/8), with chunked
prefill (64-token budget: the 150-token prompt is prefilled in three chunks) and prefix caching.

The checkpoint is a tiny one built here (config.json with ``model_type`` ``PanguProMoE``, safetensors with the
published tensor names); it loads through the config class npu-models registers with ``AutoConfig``. Reference: the
independent float64 implementation in ``pangu_moe_reference.py``, greedy.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
from npu_testkit.engine import emulated_env, engine, greedy, greedy_outputs, make_prompts
from npu_testkit.graph_e2e import MAX_BATCH, engine_kwargs, replays
from npu_testkit.pangu import build_tiny_pangu, load_tensors

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from pangu_moe_reference import PanguReference  # noqa: E402

pytestmark = pytest.mark.engine

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MAX_TOKENS = 16
PROMPTS = make_prompts([1, 5, 8, 40, 150], seed=1)
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_pangu():
    return build_tiny_pangu()


@pytest.fixture(scope="module")
def reference(tiny_pangu):
    cfg, tensors = load_tensors(tiny_pangu)
    return PanguReference(cfg, tensors)


@pytest.fixture(scope="module")
def llm(tiny_pangu, tmp_path_factory):
    kwargs = engine_kwargs("PIECEWISE", block_size=BLOCK)  # also: 64-token step budget, prefix caching
    with engine(tiny_pangu, emulated_env(tmp_path_factory.mktemp("pangu")), **kwargs) as llm:
        yield llm


def _built_layers(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm_npu.models.pangu_config import PanguProMoEConfig
    from vllm_npu.models.pangu_moe import MoGERouting

    model = worker.model_runner.get_model()
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    return {
        "model": type(model).__qualname__,
        "config": type(model.config).__name__ if isinstance(model.config, PanguProMoEConfig) else None,
        "moe": [
            (type(m).__name__, m.moe_plan.gate_path, isinstance(m.custom_routing_function, MoGERouting)) for m in moe
        ],
        "attn_impl": sorted({type(m.impl).__name__ for m in model.modules() if type(m).__name__ == "Attention"}),
        "norm": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("RMSNorm")}),
        "act": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("SiluAndMul")}),
    }


def test_the_model_runs_on_our_stack(llm):
    (info,) = llm.collective_rpc(_built_layers)
    assert info["model"] == "AscendPanguProMoEForCausalLM" and info["config"] == "PanguProMoEConfig"
    assert info["moe"] == [("AscendFusedMoE", "native", True)] * 2
    assert info["attn_impl"] == ["AscendAttentionImpl"]
    assert info["norm"] == ["NPURMSNorm"] and info["act"] == ["NPUSiluAndMul"]


def test_greedy_matches_the_float64_reference(llm, reference):
    expected, gaps = zip(*(reference.greedy(p, MAX_TOKENS) for p in PROMPTS))
    # Margins of the reference path, so a mismatch can be told from a float32 near-tie.
    assert min(gaps) > 1e-3, gaps
    before = replays(llm, "PIECEWISE")
    assert greedy(llm, PROMPTS, MAX_TOKENS) == list(expected)
    assert replays(llm, "PIECEWISE") > before  # the decode steps ran the captured graphs


def test_every_batch_size_matches_the_reference(llm, reference):
    """Batches of 1..9 sequences: padded up to a capture size, and past the largest (8) the eager fallback."""
    pool = make_prompts([3 + (7 * i) % 13 for i in range(MAX_BATCH)], seed=21)
    expected = [reference.greedy(p, 8)[0] for p in pool]
    for n in range(1, MAX_BATCH + 1):
        assert greedy(llm, pool[:n], 8) == expected[:n], f"batch of {n}"


def test_a_cached_prefix_gives_the_reference_continuation(llm, reference):
    prefix = make_prompts([2 * BLOCK + 3], seed=13)[0]
    first, second = prefix + [7, 8, 9], prefix + [21, 22]
    assert greedy(llm, [first], 8) == [reference.greedy(first, 8)[0]]
    (out,) = greedy_outputs(llm, [second], 8)
    assert out.num_cached_tokens >= 2 * BLOCK, out.num_cached_tokens
    assert list(out.outputs[0].token_ids) == reference.greedy(second, 8)[0]
