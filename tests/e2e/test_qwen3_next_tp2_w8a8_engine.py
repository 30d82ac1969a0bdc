# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen3-Next (npu-models) quantized to W8A8_DYNAMIC by ``vllm-npu quantize`` and served at tensor_parallel_size=2
with expert parallelism on the emulated device (two spawned mp workers, gloo through NPUCommunicator), eager, 64-token
step budget.

The GDN heads split over the ranks (2 key / 4 value heads: one key head and two value heads per rank, conv channels
and recurrent state sharded with them), as do the attention heads (4 query / 2 KV); the column-parallel linears (the
GDN ``in_proj_qkvz`` / ``in_proj_ba``, ``qkv_proj``, ``gate_up_proj``) and the MoE experts (whole on their rank under
expert parallelism) run the W8A8_DYNAMIC scheme. The row-parallel linears (``out_proj``, ``o_proj``, ``down_proj`` of
the dense MLP and the shared expert) are turned back to float in the checkpoint: split over TP=2, a W8A8_DYNAMIC
row-parallel linear quantises each rank's half of its input with its own per-token scale, which no single-process
simulation reproduces (as in ``test_moe_mc2_quant_engine.py``). Reference: ``vllm_npu.quant.tools.simulate`` (HF
transformers with every quantized linear replaced by the scheme's maths), greedy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts
from npu_testkit.models import build_tiny_model
from npu_testkit.models_hybrid import tiny_qwen3_next_config
from npu_testkit.quant_e2e import layer_methods

pytestmark = pytest.mark.engine

# collective_rpc pickles _gdn_shapes for the spawned workers, which cannot import this test module by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPTS = make_prompts([1, 5, 40, 150], seed=12)
NEW_TOKENS = 8


def _row_parallel(name: str) -> bool:
    return name.endswith(("out_proj.weight", "o_proj.weight")) or ("down_proj" in name and ".experts." not in name)


def _float_row_parallel(quant_dir: Path, float_dir: Path) -> None:
    """Mark the row-parallel linears FLOAT in the quantized checkpoint, with the float checkpoint's weights."""
    from safetensors.torch import load_file, save_file

    desc_path = quant_dir / "quant_model_description.json"
    desc = json.loads(desc_path.read_text())
    weights_path = quant_dir / "quant_model_weights.safetensors"
    state = load_file(str(weights_path))
    floats: dict[str, Any] = {}
    for f in float_dir.glob("*.safetensors"):
        floats.update(load_file(str(f)))
    for name in [n for n in desc if desc[n] != "FLOAT"]:
        weight = name.rsplit(".", 1)[0] + ".weight"
        if not _row_parallel(weight):
            continue
        if name == weight:
            desc[name], state[name] = "FLOAT", floats[name]
        else:  # the weight's scale / offset
            del desc[name]
            state.pop(name, None)
    desc_path.write_text(json.dumps(desc))
    save_file(state, str(weights_path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from vllm_npu.quant.tools.cli import main as quantize_main

    float_dir = build_tiny_model(tiny_qwen3_next_config())
    out = tmp_path_factory.mktemp("qwen3next-w8a8") / "ckpt"
    assert quantize_main([str(float_dir), str(out), "--scheme", "W8A8_DYNAMIC"]) == 0
    _float_row_parallel(out, float_dir)
    return out


@pytest.fixture(scope="module")
def reference(quantized):
    from vllm_npu.quant.tools.simulate import greedy as sim_greedy
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    return sim_greedy(simulated_hf_model(quantized), PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def llm(quantized, reference, tmp_path_factory):  # the reference first: no torch CPU work after the workers spawn
    env = emulated_env(tmp_path_factory.mktemp("qwen3next-tp2"), extra={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    kwargs = {
        "tensor_parallel_size": 2,
        "enable_expert_parallel": True,
        "distributed_executor_backend": "mp",
        "enforce_eager": True,
        "max_num_batched_tokens": 64,
    }
    with engine(quantized, env, **kwargs) as llm:
        yield llm


def _gdn_shapes(worker: Any) -> list[tuple[int, ...]]:
    model = worker.model_runner.get_model()
    gdn = next(m for m in model.modules() if type(m).__name__ == "NPUQwen3NextGatedDeltaNet")
    return [tuple(t.shape[1:]) for t in gdn.kv_cache[0]]


def test_gdn_heads_split_over_the_ranks_and_column_parallel_linears_and_experts_run_w8a8(llm):
    # per rank: conv state [W - 1, (2 * 2 * 16 + 4 * 16) / 2], recurrent state [4 / 2, 16, 16]
    assert llm.collective_rpc(_gdn_shapes) == [[(3, 64), (2, 16, 16)]] * 2
    for methods in llm.collective_rpc(layer_methods):
        quantized = {layer for layer, method, _ in methods if method != "float"}
        assert quantized == {"in_proj_qkvz", "in_proj_ba", "qkv_proj", "gate_up_proj", "experts"}


def test_greedy_matches_the_quant_simulation(llm, reference):
    assert greedy(llm, PROMPTS, NEW_TOKENS) == reference
