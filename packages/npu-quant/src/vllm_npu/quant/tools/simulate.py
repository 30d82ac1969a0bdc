# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Pure-torch simulation of a msModelSlim checkpoint inside a Hugging Face model (the independent reference).

:func:`simulated_hf_model` builds the HF model of a quantized checkpoint directory and replaces every quantized
``nn.Linear`` (and every MoE expert MLP's linears) by :class:`SimulatedQuantLinear`, which computes the scheme's
maths straight from the checkpoint tensors, written out here independently of the kernels and schemes used in vLLM:

- W8A8:          ``y = (round_clamp(x / s_x + o_x) @ W_qᵀ + quant_bias) * deq_scale``
- W8A8_DYNAMIC:  ``y = (round(x / s_t) @ W_qᵀ) * s_w * s_t + b``, ``s_t = max|x_t| / 127``
- W4A8_DYNAMIC:  ``y = x @ (W4 * s1 * s2[group])ᵀ + b`` (dense layers: weight-only);
  MoE experts (int8 activations, as the hardware kernel): ``y = s_t * ((round(x / s_t) - 8) @ (W4 * S)ᵀ + B)``,
  ``S = fp16(s1 * s2[group])``, ``B`` the checkpoint's ``scale_bias`` summed (version 1.0.0) or
  ``8 * sum_k W4 * s1 * s2`` (version 0)
- W4A4_FLATQUANT: ``x' = x (L ⊗ R)``; ``y = (round_clamp(x' / s_t, ±8) @ W4ᵀ) * s_w * s_t + b``,
  ``s_t = clip * max|x'_t| / 7``
- C8 (int8 KV cache): every key (after RoPE) and value the attention reads is ``round_clamp(x / s, ±128) * s``
  with the layer's per-channel ``s`` (:func:`install_c8_attention`)

Useful to check accuracy offline (HF greedy/logits of exactly the quantized maths) and in the end-to-end tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..description import DESCRIPTION_FILENAME, QuantDescription

#: a routed expert's linear (``...mlp.experts.<e>.gate_proj``); shared experts run the dense linear schemes
_EXPERT = re.compile(r"\.experts\.\d+\.")


def _dequant_scale(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64:
        return (t & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return t.float()


def _unpack_pairs(w: torch.Tensor) -> torch.Tensor:
    b = w.to(torch.int32) & 0xFF
    lo = ((b & 0xF) ^ 8) - 8
    hi = (((b >> 4) & 0xF) ^ 8) - 8
    return torch.stack([lo, hi], 1).reshape(-1, w.shape[1])


class SimulatedQuantLinear(torch.nn.Module):
    """A linear layer computing one msModelSlim scheme from checkpoint tensors (float32 maths)."""

    def __init__(
        self,
        qtype: str,
        tensors: dict[str, torch.Tensor],
        bias: torch.Tensor | None,
        settings: dict[str, Any],
        expert: bool = False,
    ):
        super().__init__()
        self.qtype = qtype
        self.expert = expert
        self.t = {k: v.clone() for k, v in tensors.items()}
        self.bias = bias
        self.settings = settings
        if qtype == "W4A8_DYNAMIC":
            w = self.t["weight"]
            w4 = _unpack_pairs(w) if str(settings.get("version", "0")) == "1.0.0" else w.to(torch.int32)
            s1 = self.t["weight_scale"].float()
            g = int(settings.get("group_size", 256))
            s = s1 * self.t["weight_scale_second"].float().repeat_interleave(g, dim=1) if g else s1
            self.w_deq = w4.float() * s
            if expert:  # the int8 x int4 expert kernel: float16-rounded scales, activations offset by 8, bias B
                self.w_a8w4 = w4.float() * s.half().float()
                sb = self.t.get("scale_bias")
                self.b_a8w4 = sb.float().sum(-1) if sb is not None else 8 * self.w_deq.sum(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, xf = self.t, x.float()
        if self.qtype == "W8A8":
            s_x, o_x = float(t["input_scale"].float()), float(t["input_offset"].float())
            xq = torch.clamp(torch.round(xf / s_x + o_x), -128, 127)
            acc = xq @ t["weight"].float().t() + t["quant_bias"].float()
            y = acc * _dequant_scale(t["deq_scale"])
        elif self.qtype == "W8A8_DYNAMIC":
            s_t = xf.abs().amax(-1, keepdim=True) / 127
            xq = torch.round(xf / s_t.clamp_min(1e-30))
            y = (xq @ t["weight"].float().t()) * t["weight_scale"].float().reshape(-1) * s_t
            y = y + (self.bias.float() if self.bias is not None else 0)
        elif self.qtype == "W4A8_DYNAMIC" and self.expert:
            s_t = xf.abs().amax(-1, keepdim=True) / 127
            xq = torch.round(xf / s_t.clamp_min(1e-30))
            y = s_t * ((xq - 8) @ self.w_a8w4.t() + self.b_a8w4)
        elif self.qtype == "W4A8_DYNAMIC":
            y = xf @ self.w_deq.t() + (self.bias.float() if self.bias is not None else 0)
        elif self.qtype == "W4A4_FLATQUANT_DYNAMIC":
            left, right = t["left_trans"].float(), t["right_trans"].float()
            nl, nr = left.shape[0], right.shape[0]
            lead = xf.shape[:-1]
            xt = (left.t() @ xf.reshape(-1, nl, nr) @ right).reshape(*lead, nl * nr)
            s_t = float(t["clip_ratio"].float()) * xt.abs().amax(-1, keepdim=True) / 7
            xq = torch.clamp(torch.round(xt / s_t.clamp_min(1e-30)), -8, 7)
            y = (xq @ t["weight"].float().t()) * t["weight_scale"].float().reshape(-1) * s_t
            y = y + (self.bias.float() if self.bias is not None else 0)
        else:
            raise ValueError(f"no simulation for {self.qtype}")
        return y.to(x.dtype)


_C8_ATTENTION = "npu_c8_simulation"


def c8_scales(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{attention block: (k_scale, v_scale)}`` from a C8 checkpoint's tensors, in either spelling
    (``<block>.k_proj.kv_cache_scale`` / ``<block>.attn.key_antiquant_scale`` and their V twins)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, tensor in state.items():
        for k_suffix, v_suffix in ((".k_proj.kv_cache_scale", ".v_proj.kv_cache_scale"),
                                   (".attn.key_antiquant_scale", ".attn.value_antiquant_scale")):  # fmt: skip
            if name.endswith(k_suffix):
                block = name[: -len(k_suffix)]
                out[block] = (tensor.float(), state[block + v_suffix].float())
    return out


def install_c8_attention(model: torch.nn.Module, scales: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make ``model``'s attention read fake-quantized K/V: an attention implementation (transformers'
    ``AttentionInterface``) that rounds ``key_states`` (after RoPE) and ``value_states`` ``[B, Nkv, S, D]`` to the
    int8 grid of the block's per-channel scales ``[Nkv * D]``, then runs SDPA."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    names = {id(m): n for n, m in model.named_modules()}

    def fake_quant(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        s = s.view(1, x.shape[1], 1, x.shape[3])
        return (torch.clamp(torch.round(x.float() / s), -128, 127) * s).to(x.dtype)

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any,
                  **kw: Any) -> Any:  # fmt: skip
        k_scale, v_scale = scales[names[id(module)]]
        return sdpa_attention_forward(module, query, fake_quant(key, k_scale), fake_quant(value, v_scale), *a, **kw)

    AttentionInterface.register(_C8_ATTENTION, attention)
    config: Any = model.config  # a transformers PretrainedConfig (nn.Module types attributes as Tensor | Module)
    config._attn_implementation = _C8_ATTENTION


def simulated_hf_model(quant_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The HF causal LM of ``quant_dir`` with every quantized linear replaced by :class:`SimulatedQuantLinear` (and,
    for a C8 checkpoint, its attention reading fake-quantized K/V: :func:`install_c8_attention`)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    quant_dir = Path(quant_dir)
    desc = QuantDescription.from_file(quant_dir / DESCRIPTION_FILENAME)
    cfg_dict = json.loads((quant_dir / "config.json").read_text())
    cfg_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**cfg_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(quant_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    modules = dict(model.named_modules())
    replaced: set[str] = set()  # checkpoint tensors the simulated quant layers took over
    for name, mod in modules.items():
        if not isinstance(mod, torch.nn.Linear):
            continue
        qtype = desc.tensors.get(f"{name}.weight")
        if qtype in (None, "FLOAT"):
            continue
        tensors = {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(name + ".") and k != f"{name}.bias"}
        bias = state.get(f"{name}.bias")
        parent_name, _, child = name.rpartition(".")
        setattr(
            modules[parent_name] if parent_name else model,
            child,
            SimulatedQuantLinear(qtype, tensors, bias, desc.settings, expert=_EXPERT.search(name) is not None),
        )
        for k in tensors:
            replaced.add(f"{name}.{k}")
    expected = model.state_dict()
    missing, _ = model.load_state_dict(
        {k: v for k, v in state.items() if k not in replaced and k in expected}, strict=False
    )
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"simulated model: float tensors missing from {quant_dir}: {missing[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    if desc.kv_c8:
        scales = c8_scales(state)
        if not scales:
            raise ValueError(f"simulated model: {quant_dir} is C8 but has no KV-cache scales")
        install_c8_attention(model, scales)
    model.eval()
    return model


@torch.no_grad()
def greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt (no KV cache: full recompute per step; tiny models only)."""
    outs = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
        outs.append(seq[len(ids) :])
    return outs


@torch.no_grad()
def logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` log-softmax of ``model`` on ``ids``."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
