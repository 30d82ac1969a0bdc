# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Registration, checkpoint detection (claim ModelSlim only), CLI choice and layer dispatch of ``ascend``."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from vllm_npu.quant.config import QUANT_METHOD, AscendQuantConfig, register
from vllm_npu.quant.description import QuantDescription, QuantDescriptionError
from vllm_npu.quant.detect import claim_checkpoint

MODELSLIM_INLINE = {  # old msModelSlim: the description inside config.json's quantization_config (#633)
    "model_quant_type": "W8A8",
    "model.embed_tokens.weight": "FLOAT",
    "model.layers.0.self_attn.q_proj.weight": "W8A8",
}


def test_register_is_idempotent_and_resolvable() -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    register()
    register()  # vLLM raises on a second registration: the guard must absorb it
    assert QUANTIZATION_METHODS.count(QUANT_METHOD) == 1
    assert get_quantization_config(QUANT_METHOD) is AscendQuantConfig


@pytest.mark.parametrize(
    "hf_quant_cfg, user, claimed",
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, None, False),  # #4313: FP8 must stay FP8
        ({"quant_method": "awq", "bits": 4}, None, False),
        ({"quant_method": "compressed-tensors", "config_groups": {}}, None, False),
        (MODELSLIM_INLINE, None, True),
        ({"quant_method": "ascend"}, None, True),
        ({"quant_method": "ascend"}, "ascend", True),
        (MODELSLIM_INLINE, "fp8", False),  # never override an explicit other choice
    ],
)
def test_override_claims_only_modelslim(hf_quant_cfg: dict, user: str | None, claimed: bool) -> None:
    got = AscendQuantConfig.override_quantization_method(dict(hf_quant_cfg), user)
    assert got == (QUANT_METHOD if claimed else None)


def test_from_config_inline_and_file(tmp_path: Path) -> None:
    inline = AscendQuantConfig.from_config(dict(MODELSLIM_INLINE))
    assert (
        inline.description is not None
        and inline.description.tensors["model.layers.0.self_attn.q_proj.weight"] == "W8A8"
    )
    marker = AscendQuantConfig.from_config({"quant_method": "ascend"})
    assert marker.description is None
    with pytest.raises(QuantDescriptionError, match="quant_model_description.json"):
        marker.maybe_update_config(str(tmp_path))
    (tmp_path / "quant_model_description.json").write_text(json.dumps(MODELSLIM_INLINE))
    marker.maybe_update_config(str(tmp_path))
    assert marker.description is not None


def test_attention_quantization_is_refused_and_c8_is_read(tmp_path: Path) -> None:
    (tmp_path / "quant_model_description.json").write_text(json.dumps({**MODELSLIM_INLINE, "fa_quant_type": "FA3"}))
    with pytest.raises(QuantDescriptionError, match="fa_quant_type='FA3'"):
        AscendQuantConfig(None).maybe_update_config(str(tmp_path))
    for key in ("kv_quant_type", "kv_cache_type"):  # vllm-ascend's and msModelSlim's spelling (issue #30)
        (tmp_path / "quant_model_description.json").write_text(json.dumps({**MODELSLIM_INLINE, key: "C8"}))
        config = AscendQuantConfig(None)
        config.maybe_update_config(str(tmp_path))
        assert config.description is not None and config.description.kv_c8


def _fake_vllm_config(model_dir: Path, quantization: str | None = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=str(model_dir), quantization=quantization),
        load_config=None,
        quant_config=None,
    )


def test_claim_checkpoint_ignores_other_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cfg = _fake_vllm_config(tmp_path)
    assert claim_checkpoint(cfg) is False and cfg.model_config.quantization is None
    (tmp_path / "quant_model_description.json").write_text(json.dumps(MODELSLIM_INLINE))
    cfg = _fake_vllm_config(tmp_path, quantization="fp8")
    assert claim_checkpoint(cfg) is False and cfg.model_config.quantization == "fp8"


def test_claim_checkpoint_selects_ascend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import VllmConfig

    (tmp_path / "quant_model_description.json").write_text(json.dumps(MODELSLIM_INLINE))
    seen = {}

    def fake_get(model_config, load_config):  # VllmConfig's own builder needs a full ModelConfig
        seen["quantization"] = model_config.quantization
        return "built"

    monkeypatch.setattr(VllmConfig, "_get_quantization_config", staticmethod(fake_get))
    cfg = _fake_vllm_config(tmp_path)
    assert claim_checkpoint(cfg) is True
    assert cfg.model_config.quantization == QUANT_METHOD and cfg.quant_config == "built"
    assert seen["quantization"] == QUANT_METHOD


def test_cli_accepts_ascend_without_wiring() -> None:
    """vLLM 0.11 declares --quantization without argparse choices (ModelConfig validates against
    QUANTIZATION_METHODS, which our registration extends), so the plugin adds no CLI choice. If a vLLM bump gives
    the option choices, this fails and the CLI needs wiring again."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser.parse_args(["--quantization", "ascend"]).quantization == "ascend"


def test_dispatch_float_embedding_and_errors(vllm_ctx: object) -> None:
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    desc = {
        "model.layers.0.mlp.gate.weight": "FLOAT",
        "model.layers.0.mlp.down_proj.weight": "W8A8_DYNAMIC",
        "model.embed_tokens.weight": "W8A8",
        "model.layers.0.mlp.up_proj.weight": "C8",
    }
    cfg = AscendQuantConfig(QuantDescription.from_mapping(desc))
    gate = ReplicatedLinear(16, 4, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.gate")
    assert isinstance(gate.quant_method, UnquantizedLinearMethod)
    # lm_head absent from the description (#8367): stays float instead of a KeyError
    head = ParallelLMHead(64, 16, quant_config=cfg, prefix="lm_head")
    assert head.weight.dtype == torch.get_default_dtype()
    with pytest.raises(QuantDescriptionError, match="quantized embeddings"):
        VocabParallelEmbedding(64, 16, quant_config=cfg, prefix="model.embed_tokens")
    with pytest.raises(QuantDescriptionError, match="'C8'"):
        ReplicatedLinear(16, 8, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.up_proj")
    with pytest.raises(QuantDescriptionError, match="model.layers.1.mlp.down_proj"):
        ReplicatedLinear(16, 8, bias=False, quant_config=cfg, prefix="model.layers.1.mlp.down_proj")


def test_dynamic_eplb_takes_quantised_experts_that_declare_they_move() -> None:
    """``--enable-eplb`` no longer refuses quantised experts: every MoE method declares npu-interface's
    ``EplbMovableExperts`` (npu-ops' layer refuses a method that does not; test_moe_eplb.py moves them)."""
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm_npu.interface import moves_experts_with_eplb
    from vllm_npu.quant.moe_method import (
        AscendW4A8DynamicFusedMoEMethod,
        AscendW8A8DynamicFusedMoEMethod,
        AscendW8A8FusedMoEMethod,
    )

    desc = {
        f"model.layers.0.mlp.experts.{e}.{w}.weight": "W8A8_DYNAMIC"
        for e in range(2)
        for w in ("gate_proj", "up_proj", "down_proj")
    }
    cfg = AscendQuantConfig(QuantDescription.from_mapping(desc))
    layer = FusedMoE.__new__(FusedMoE)  # only what get_quant_method reads: the type, enable_eplb, moe_config
    torch.nn.Module.__init__(layer)
    layer.enable_eplb = True
    layer.moe_config = None
    method = cfg.get_quant_method(layer, "model.layers.0.mlp.experts")
    assert isinstance(method, AscendW8A8DynamicFusedMoEMethod) and moves_experts_with_eplb(method)
    for cls in (AscendW4A8DynamicFusedMoEMethod, AscendW8A8FusedMoEMethod):
        assert moves_experts_with_eplb(cls)
