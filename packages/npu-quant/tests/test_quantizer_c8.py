# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu quantize --kv-cache C8``: calibrated per-channel K/V scales in msModelSlim's spelling, and the
simulation reading fake-quantized K/V."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from vllm_npu.quant.description import QuantDescription
from vllm_npu.quant.tools.cli import main
from vllm_npu.quant.tools.quantize_paths import QuantizeError
from vllm_npu.quant.tools.quantizer import quantize_checkpoint

NKV_D = 2 * 16  # tiny qwen2: 2 KV heads of 16


@pytest.fixture(scope="module")
def float_dir() -> Path:
    from npu_testkit.engine import tiny_config
    from npu_testkit.models import build_tiny_model

    return build_tiny_model(tiny_config("qwen2"), dtype="bfloat16")


@pytest.fixture(scope="module")
def c8_dir(float_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("c8") / "q"
    assert main([str(float_dir), str(out), "--scheme", "W8A8_DYNAMIC", "--kv-cache", "C8"]) == 0
    return out


def test_c8_checkpoint_layout(c8_dir: Path) -> None:
    desc = QuantDescription.from_file(c8_dir / "quant_model_description.json")
    state = load_file(str(c8_dir / "quant_model_weights.safetensors"))
    assert desc.kv_c8 and desc.settings["kv_cache_type"] == "C8" and "kv_quant_type" not in desc.settings
    assert set(desc.tensors) == set(state)
    for layer in range(2):
        for proj in ("k_proj", "v_proj"):
            scale = state[f"model.layers.{layer}.self_attn.{proj}.kv_cache_scale"]
            offset = state[f"model.layers.{layer}.self_attn.{proj}.kv_cache_offset"]
            assert scale.shape == (NKV_D,) and scale.dtype == torch.bfloat16 and bool((scale > 0).all())
            assert offset.shape == (NKV_D,) and not bool(offset.any())
            assert desc.tensors[f"model.layers.{layer}.self_attn.{proj}.kv_cache_scale"] == "W8A8_DYNAMIC"
    # per channel: the K scales of one layer are not all equal (RoPE'd keys differ channel by channel)
    assert state["model.layers.0.self_attn.k_proj.kv_cache_scale"].unique().numel() > 4


def test_calibrated_scales_cover_the_calibration_keys(float_dir: Path) -> None:
    # independent check of "max |K after RoPE| / 127": HF's eager attention receives the rotated keys
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm_npu.quant.tools.quantize_kv import calibrate_kv
    from vllm_npu.quant.tools.quantizer import DEFAULT_CALIBRATION

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(float_dir)
    scales = calibrate_kv(model, tok, DEFAULT_CALIBRATION)
    seen: dict[str, torch.Tensor] = {}
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    original = qwen2.eager_attention_forward

    def spy(module, query, key, value, *a, **kw):
        name = f"model.layers.{module.layer_idx}.self_attn"
        amax = key.abs().amax(dim=(0, 2)).reshape(-1)
        seen[name] = amax if name not in seen else torch.maximum(seen[name], amax)
        return original(module, query, key, value, *a, **kw)

    qwen2.eager_attention_forward = spy
    try:
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            for prompt in DEFAULT_CALIBRATION:
                model(tok(prompt, return_tensors="pt").input_ids)
    finally:
        qwen2.eager_attention_forward = original
    for block, amax in seen.items():
        torch.testing.assert_close(scales[f"{block}.k_proj.kv_cache_scale"], amax / 127)


def test_simulation_reads_fake_quantized_kv(c8_dir: Path, float_dir: Path, tmp_path: Path) -> None:
    from vllm_npu.quant.tools.simulate import logprobs, simulated_hf_model

    plain = tmp_path / "plain"
    quantize_checkpoint(float_dir, plain, "W8A8_DYNAMIC")
    ids = list(range(3, 40))
    with_c8, without = logprobs(simulated_hf_model(c8_dir), ids), logprobs(simulated_hf_model(plain), ids)
    kl = (without.exp() * (without - with_c8)).sum(-1)  # KL(no C8 || C8) per position
    # the int8 K/V grid changes the distribution a little (measured on this random 64-wide model, ids outside the
    # calibration prompts: mean 0.007, worst 0.10 nats), never much
    assert 0 < kl.mean().item() < 0.02 and kl.max().item() < 0.2, kl


def test_unknown_kv_cache_scheme_is_refused(float_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="unknown KV-cache scheme 'C4'"):
        quantize_checkpoint(float_dir, tmp_path / "q", "W8A8_DYNAMIC", kv_cache="C4")
    with pytest.raises(SystemExit):
        main([str(float_dir), str(tmp_path / "q2"), "--scheme", "W8A8_DYNAMIC", "--kv-cache", "C4"])


def test_calib_file_applies_to_the_kv_cache_calibration(float_dir: Path, tmp_path: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text("a b c d e f\nthe same prompt again and again\n")
    args = [str(float_dir), str(tmp_path / "q"), "--scheme", "W8A8_DYNAMIC", "--calib-file", str(calib)]
    assert main(args) == 2  # without --kv-cache: W8A8 only (unchanged)
    assert main([*args, "--kv-cache", "C8"]) == 0
    own = load_file(str(tmp_path / "q" / "quant_model_weights.safetensors"))
    default = quantize_checkpoint(float_dir, tmp_path / "d", "W8A8_DYNAMIC", kv_cache="C8")
    other = load_file(str(default / "quant_model_weights.safetensors"))
    key = "model.layers.0.self_attn.k_proj.kv_cache_scale"
    assert not torch.equal(own[key], other[key])  # calibrated on the file's prompts, not the built-in ones
