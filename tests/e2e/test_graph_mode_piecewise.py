# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu.graph_mode='piecewise'`` on the emulated device: Dynamo captures the model, vLLM splits it at the attention
op (our backend runs between the pieces), the pieces run as FX graphs. Greedy output must equal HF.

Every layer is loaded, the ops layer included: its CustomOp overrides are traced into the pieces (the RoPE
override's per-forward cos/sin cache steps aside while Dynamo traces). The engine core runs in its own (spawned)
process, so that overrides registered in this pytest process by other modules do not apply.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy
from npu_testkit.models import hf_greedy

pytestmark = pytest.mark.engine

ALL_PLUGINS = "npu,npu_ops,npu_attention,npu_patches,npu_models,npu_quant"


@pytest.fixture(scope="module")
def llm(tiny_qwen2, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("piecewise"), multiprocessing=True, extra={"VLLM_PLUGINS": ALL_PLUGINS})
    with engine(tiny_qwen2, env, additional_config={"npu": {"graph_mode": "piecewise"}}) as llm:
        yield llm


def test_piecewise_graphs_split_at_attention(llm):
    comp = llm.llm_engine.vllm_config.compilation_config
    assert comp.level == 3 and not comp.use_inductor
    assert "vllm.unified_attention_with_output" in comp.splitting_ops
    assert not llm.llm_engine.vllm_config.model_config.enforce_eager
    (info,) = llm.collective_rpc("npu_runtime_info")
    # 2 decoder layers -> split at 2 attention ops -> at least 3 graph pieces
    assert info["compilation_level"] == 3 and info["piecewise_graphs_seen"] >= 3, info
    assert "ops" in info["components"], info
    assert info["attention_backends"] == ["vllm_npu.attention.backends.gqa.AscendAttentionBackend"]


def test_piecewise_greedy_matches_hf(llm, tiny_qwen2, prompts):
    assert greedy(llm, prompts, 16) == hf_greedy(tiny_qwen2, prompts, 16)
