# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The quantizer (``vllm-npu quantize``): files, description contents, errors; and vLLM's checkpoint detection with a
real ``ModelConfig``: our output is claimed as ``ascend``, float and FP8 checkpoints are not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from vllm_npu.quant.description import QuantDescription
from vllm_npu.quant.tools.cli import main


@pytest.fixture(scope="module")
def float_dir() -> Path:
    from npu_testkit.engine import tiny_config
    from npu_testkit.models import build_tiny_model

    return build_tiny_model(tiny_config("qwen2"))


@pytest.mark.parametrize("scheme", ["W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A4_FLATQUANT"])
def test_quantize_writes_a_modelslim_checkpoint(float_dir: Path, tmp_path: Path, scheme: str) -> None:
    out = tmp_path / "q"
    assert main([str(float_dir), str(out), "--scheme", scheme]) == 0
    for name in ("quant_model_weights.safetensors", "quant_model_description.json", "config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    desc = QuantDescription.from_file(out / "quant_model_description.json")
    state = load_file(str(out / "quant_model_weights.safetensors"))
    qtype = "W4A4_FLATQUANT_DYNAMIC" if scheme == "W4A4_FLATQUANT" else scheme
    assert desc.settings["model_quant_type"] == qtype
    assert set(desc.tensors) == set(state), "every tensor is described, and only those"
    assert desc.tensors["model.layers.0.self_attn.q_proj.weight"] == qtype
    assert desc.tensors["model.layers.1.mlp.down_proj.weight"] == qtype
    for floaty in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ):
        assert desc.tensors[floaty] == "FLOAT", floaty
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {"quant_method": "ascend"}
    if scheme == "W8A8":  # q/k/v see the same input, so their calibrated activation scales are identical
        scales = {s: state[f"model.layers.0.self_attn.{s}_proj.input_scale"] for s in "qkv"}
        assert torch.equal(scales["q"], scales["k"]) and torch.equal(scales["q"], scales["v"])


def test_w4a8_packed_format(float_dir: Path, tmp_path: Path) -> None:
    assert (
        main(
            [
                str(float_dir),
                str(tmp_path / "q"),
                "--scheme",
                "W4A8_DYNAMIC",
                "--w4a8-version",
                "1.0.0",
                "--group-size",
                "32",
            ]
        )
        == 0
    )
    desc = QuantDescription.from_file(tmp_path / "q" / "quant_model_description.json")
    state = load_file(str(tmp_path / "q" / "quant_model_weights.safetensors"))
    assert desc.version == "1.0.0" and desc.group_size == 32
    assert state["model.layers.0.mlp.gate_proj.weight"].shape == (64, 64)  # [N/2, K] for N=128
    assert state["model.layers.0.mlp.down_proj.scale_bias"].shape == (64, 16)  # row-parallel
    assert state["model.layers.0.mlp.gate_proj.scale_bias"].shape == (128, 1)


def test_bad_requests_exit_2(float_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), str(tmp_path / "q"), "--scheme", "W8A8"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main([str(float_dir), str(tmp_path / "q"), "--scheme", "W4A8_DYNAMIC", "--group-size", "48"]) == 2
    assert "group size 48 does not divide" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(float_dir), str(tmp_path / "q"), "--scheme", "W3A3"])


def _model_config(path: Path):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(path), dtype="float32")


def test_vllm_detects_ours_and_leaves_others(float_dir: Path, tmp_path: Path) -> None:
    from vllm_npu.quant.config import register

    register()
    assert _model_config(float_dir).quantization is None  # a float checkpoint is not claimed
    ours = tmp_path / "ours"
    assert main([str(float_dir), str(ours), "--scheme", "W8A8_DYNAMIC"]) == 0
    assert _model_config(ours).quantization == "ascend"
    fp8 = tmp_path / "fp8"
    shutil.copytree(float_dir, fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    # FP8 stays FP8 (vllm-ascend would claim it as 'ascend' and fail on a KeyError, #4313); the NPU platform then
    # says FP8 is unsupported, naming fp8.
    with pytest.raises(ValueError, match="fp8 quantization is currently not supported"):
        _model_config(fp8)


def test_explicit_ascend_reads_the_description_file(float_dir: Path, tmp_path: Path) -> None:
    """New msModelSlim layout: no quantization_config in config.json, only quant_model_description.json; with
    ``quantization="ascend"`` vLLM finds the file through get_config_filenames."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config
    from vllm_npu.quant.config import AscendQuantConfig, register

    register()
    out = tmp_path / "q"
    assert main([str(float_dir), str(out), "--scheme", "W8A8_DYNAMIC"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert _model_config(out).quantization is None  # vLLM alone does not look at the file...
    from vllm.config import ModelConfig

    mc = ModelConfig(model=str(out), dtype="float32", quantization="ascend")  # ...the user (or the platform) selects it
    qc = get_quant_config(mc, LoadConfig())
    assert isinstance(qc, AscendQuantConfig) and qc.description is not None
    assert qc.description.tensors["model.layers.0.mlp.down_proj.weight"] == "W8A8_DYNAMIC"
