# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""npu-patches on a real vLLM 0.11.0 engine (emulated device, tiny Qwen2, float32): the worker applied the patches,
and the behaviour each one fixes works end to end. One engine for the module (in-process engine core, so the
worker's patched vLLM is this process's vLLM).

- repetition-penalty-torch: greedy decoding with ``repetition_penalty`` matches HF transformers' greedy decoding with
  the same penalty, also while tensors claim ``is_cuda`` the way torch_npu makes NPU tensors claim it under
  ``transfer_to_npu`` (without the patch that path needs vLLM's missing ``_C`` kernel: see
  packages/npu-patches/tests/test_repetition_penalty.py).
- attention-output-empty: the patched ``Attention.forward`` is on the model's path and greedy output still matches
  HF; with an impl that declares ``fills_output_buffer``, the buffer is poisoned with NaN and the output still matches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
PENALTY = 1.8


@pytest.fixture(scope="module")
def llm(tiny_qwen2, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("patches"), extra={"VLLM_NPU_PATCHES": "all"})
    with engine(tiny_qwen2, env) as llm:
        yield llm


def _worker_view(worker: Any) -> dict[str, Any]:
    """Runs inside the worker (collective_rpc): patch states and what the model's attention layers run."""
    import vllm._custom_ops as ops
    from vllm.attention.layer import Attention
    from vllm_npu.patches import patch_status

    layers = [m for m in worker.model_runner.model.modules() if isinstance(m, Attention)]
    return {
        "status": {k: (s.value, r) for k, (s, r) in patch_status().items()},
        "penalty_fn": getattr(ops.apply_repetition_penalties, "__vllm_npu_patch__", None),
        "attention_forward": [getattr(type(m).forward, "__vllm_npu_patch__", None) for m in layers],
        "impls": sorted({f"{type(m.impl).__module__}.{type(m.impl).__qualname__}" for m in layers}),
        "declaring_impls": sum(bool(getattr(m.impl, "fills_output_buffer", False)) for m in layers),
    }


def hf_greedy_with_penalty(model_dir, prompts: list[list[int]], max_new_tokens: int, penalty: float) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            inp = torch.tensor([ids])
            gen = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                repetition_penalty=penalty,
                pad_token_id=model.config.pad_token_id,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module")
def view(llm) -> dict[str, Any]:
    (info,) = llm.collective_rpc(_worker_view)
    return info


@pytest.fixture(scope="module")
def short_prompts() -> list[list[int]]:
    return make_prompts([4, 9, 23], seed=5)


def test_worker_applied_the_patches(view):
    assert view["status"]["repetition-penalty-torch"][0] == "applied", view["status"]
    assert view["status"]["attention-output-empty"][0] == "applied", view["status"]
    assert view["penalty_fn"] == "repetition-penalty-torch"
    assert view["attention_forward"] and set(view["attention_forward"]) == {"attention-output-empty"}


def test_repetition_penalty_sampling_matches_hf(llm, tiny_qwen2, short_prompts):
    want = hf_greedy_with_penalty(tiny_qwen2, short_prompts, MAX_TOKENS, PENALTY)
    got = greedy(llm, short_prompts, MAX_TOKENS, repetition_penalty=PENALTY)
    assert got == want
    # the penalty changes the continuation here (otherwise the test would not exercise it)
    assert got != greedy(llm, short_prompts, MAX_TOKENS)


def test_repetition_penalty_with_npu_like_is_cuda(llm, tiny_qwen2, short_prompts, monkeypatch):
    """torch_npu's transfer_to_npu makes every NPU tensor report is_cuda; vLLM then wants its CUDA-only kernel."""
    want = hf_greedy_with_penalty(tiny_qwen2, short_prompts, MAX_TOKENS, PENALTY)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "cpu"))
    got = greedy(llm, short_prompts, MAX_TOKENS, repetition_penalty=PENALTY)
    monkeypatch.undo()
    assert got == want


def test_greedy_through_patched_attention_matches_hf(llm, tiny_qwen2, prompts):
    from npu_testkit.models import hf_greedy

    assert greedy(llm, prompts, MAX_TOKENS) == hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)


def test_empty_output_path_with_poisoned_buffer(llm, tiny_qwen2, short_prompts, view, monkeypatch):
    """Take the torch.empty path for the model's attention impl and poison the buffer with NaN: generation still
    matches HF, so on these steps the impl overwrites every element.

    The impl here is npu-attention's; if it does not declare ``fills_output_buffer`` itself, the test declares it
    for the duration (the steps are eager prefill/decode steps without padding, which is what this shows; the
    profile run is not covered, which is why the impl must declare the flag itself before production uses it).
    """
    import vllm_npu.patches.sets.attention_output as mod
    from vllm.attention.layer import Attention

    impl_classes = set()
    for module in llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.modules():
        if isinstance(module, Attention):
            impl_classes.add(type(module.impl))
    for cls in impl_classes:
        monkeypatch.setattr(cls, "fills_output_buffer", True, raising=False)
    calls = []
    real = mod.new_output

    def poisoned(*args: Any) -> torch.Tensor:
        calls.append(args[0])
        return real(*args).fill_(float("nan"))

    monkeypatch.setattr(mod, "new_output", poisoned)
    got = greedy(llm, short_prompts, MAX_TOKENS)
    monkeypatch.undo()
    assert calls, "the patched forward never took the torch.empty path"
    from npu_testkit.models import hf_greedy

    assert got == hf_greedy(tiny_qwen2, short_prompts, MAX_TOKENS)
