# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Shared end-to-end checks of the ``ascend`` quant method: one :class:`QuantCase` per scheme and model.

A case quantizes a tiny float checkpoint with ``vllm-npu quantize`` and the test modules run it through real vLLM on
the emulated device (the quant method is picked from the checkpoint: no ``quantization=`` argument), then check:

- which quant method and scheme every linear / MoE layer runs (:func:`layer_methods`);
- greedy tokens equal a pure-torch model running the same checkpoint tensors (:func:`check_greedy`;
  ``vllm_npu.quant.tools.simulate``: HF transformers with every quantized linear replaced by the scheme's maths, written
  independently of the kernels);
- next-token log-probs over the whole vocabulary equal the simulation's within 1e-3 (max abs) and stay close to the
  float model's: KL(float || quantized) <= the case's bound, in nats (:func:`check_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from npu_testkit.engine import greedy, make_prompts, tiny_config, token_prompts

PROMPT_LENGTHS = (1, 5, 20)
MAX_TOKENS = 8
#: The prompts every quant e2e module generates from.
PROMPTS = make_prompts(list(PROMPT_LENGTHS), seed=1)


@dataclass(frozen=True)
class QuantCase:
    """``scheme`` for ``vllm-npu quantize`` on the tiny ``model`` ("qwen2" dense or "qwen3_moe"); ``methods`` is the
    expected sorted ``(layer, method, scheme)`` set; ``kl_bound`` is in nats (measured values in the comment)."""

    id: str
    scheme: str
    model: str
    kl_bound: float
    methods: list[tuple[str, str, str]]
    quantize_args: tuple[str, ...] = field(default=())


def dense_methods(scheme_cls: str) -> list[tuple[str, str, str]]:
    return [(name, "AscendLinearMethod", scheme_cls) for name in ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")]


def moe_methods(moe_method: str, scheme_cls: str) -> list[tuple[str, str, str]]:
    return [
        ("experts", moe_method, "NoneType"),
        ("gate", "float", "NoneType"),
        ("o_proj", "AscendLinearMethod", scheme_cls),
        ("qkv_proj", "AscendLinearMethod", scheme_cls),
    ]


def tiny_float_model(kind: str) -> Path:
    """The tiny float checkpoint of ``kind``: "qwen2" (dense), "qwen3_moe" or "deepseek_v3" (MLA + MoE)
    (:func:`npu_testkit.engine.tiny_config`)."""
    from npu_testkit.models import build_tiny_model

    if kind not in ("qwen2", "qwen3_moe", "deepseek_v3"):
        raise ValueError(f"unknown tiny model {kind!r}")
    return build_tiny_model(tiny_config(kind))


def quantize(case: QuantCase, out_root: Path) -> tuple[Path, Path]:
    """(float checkpoint, quantized checkpoint) of ``case``; the quantized one is written under ``out_root``."""
    from vllm_npu.quant.tools.cli import main as quantize_main

    float_dir = tiny_float_model(case.model)
    quant_dir = out_root / case.id
    assert quantize_main([str(float_dir), str(quant_dir), "--scheme", case.scheme, *case.quantize_args]) == 0
    return float_dir, quant_dir


def layer_methods(worker: Any) -> list[tuple[str, str, str]]:
    """Inside the worker: sorted ``(layer, quant method, scheme)`` of every linear and MoE layer."""
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.get_model()
    found = set()
    for name, m in model.named_modules():
        if isinstance(m, (LinearBase, FusedMoE)):
            method = type(m.quant_method).__name__
            scheme = type(getattr(m.quant_method, "scheme", None)).__name__
            found.add((name.rsplit(".", 1)[-1], "float" if "Unquantized" in method else method, scheme))
    return sorted(found)


def next_token_logprobs(llm: Any, prompt: list[int], vocab: int):
    """The engine's log-probs of the next token over the whole vocabulary (``max_logprobs=-1`` engines)."""
    import torch
    from vllm import SamplingParams

    out = llm.generate(
        token_prompts([prompt]), SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1), use_tqdm=False
    )
    lp = torch.full((vocab,), float("-inf"))
    for token, logprob in out[0].outputs[0].logprobs[0].items():
        lp[token] = logprob.logprob
    return lp


def check_greedy(llm: Any, simulated: Any, prompts: list[list[int]] = PROMPTS) -> None:
    """The engine's greedy tokens (``MAX_TOKENS`` per prompt) equal the simulation's."""
    from vllm_npu.quant.tools.simulate import greedy as sim_greedy

    got = greedy(llm, prompts, MAX_TOKENS)
    assert all(len(g) == MAX_TOKENS for g in got)
    assert got == sim_greedy(simulated, prompts, MAX_TOKENS)


def check_logprobs(llm: Any, simulated: Any, float_dir: Path, case: QuantCase, prompts: list[list[int]]) -> None:
    from vllm_npu.quant.tools.simulate import logprobs as sim_logprobs

    from npu_testkit.models import hf_logprobs

    for prompt in prompts:
        sim = sim_logprobs(simulated, prompt)[-1]
        got = next_token_logprobs(llm, prompt, sim.shape[0])
        assert float((got - sim).abs().max()) <= 1e-3
        ref = hf_logprobs(float_dir, prompt)[-1]
        kl = float((ref.exp() * (ref - got)).sum())
        assert kl <= case.kl_bound, (
            f"KL(float || {case.id}) = {kl:.4f} > {case.kl_bound} for a {len(prompt)}-token prompt"
        )
