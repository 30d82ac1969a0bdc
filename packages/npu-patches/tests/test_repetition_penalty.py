# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""repetition-penalty-torch: vLLM's sampler penalty path on tensors that claim ``is_cuda`` (what torch_npu does to
NPU tensors under transfer_to_npu / TORCH_NPU_SANITIZER) fails without the patch and is right with it.

This host has no ``vllm._C`` (it fails to load without libcuda), exactly like vLLM built with
``VLLM_TARGET_DEVICE=empty`` on an Ascend host, so the failure is the real one.
"""

from __future__ import annotations

import pytest
import torch
from vllm_npu.patches import PatchRegistry
from vllm_npu.patches.sets import REPETITION_PENALTY_TORCH

pytestmark = pytest.mark.usefixtures("vllm_unpatched")

VOCAB = 50


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, VOCAB, generator=g)
    prompt = torch.randint(0, VOCAB, (3, 7), generator=g)
    prompt[2, 5:] = VOCAB  # padding (vLLM pads with vocab_size)
    output = torch.randint(0, VOCAB, (3, 4), generator=g)
    return logits, prompt, output


def reference(logits, prompt, output, rep, freq, pres):
    """Plain-loop definition (HF/OpenAI semantics) over python lists."""
    out = logits.clone()
    for s in range(out.shape[0]):
        seen_prompt = {t for t in prompt[s].tolist() if t < VOCAB}
        counts: dict[int, int] = {}
        for t in output[s].tolist():
            counts[t] = counts.get(t, 0) + 1
        for t in range(VOCAB):
            x = out[s, t].item()
            if t in seen_prompt or t in counts:
                x = x / rep[s].item() if x > 0 else x * rep[s].item()
            x -= freq[s].item() * counts.get(t, 0) + pres[s].item() * (t in counts)
            out[s, t] = x
    return out


def run_vllm_penalties(logits, prompt, output, rep, freq, pres):
    from vllm.model_executor.layers.utils import apply_penalties

    return apply_penalties(logits.clone(), prompt, output, pres, freq, rep)


@pytest.fixture
def npu_like_is_cuda(monkeypatch):
    """What torch_npu's transfer_to_npu does: ``Tensor.is_cuda = Tensor.is_npu`` (here every tensor is "npu")."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


PARAMS = (torch.tensor([1.3, 1.0, 2.0]), torch.tensor([0.0, 0.5, 0.1]), torch.tensor([0.2, 0.0, 0.3]))


def test_without_aliasing_vllm_already_takes_the_torch_path():
    logits, prompt, output = inputs()
    got = run_vllm_penalties(logits, prompt, output, *PARAMS)
    torch.testing.assert_close(got, reference(logits, prompt, output, *PARAMS), rtol=1e-6, atol=1e-6)


def test_aliased_is_cuda_breaks_unpatched_vllm(npu_like_is_cuda):
    logits, prompt, output = inputs()
    with pytest.raises(AttributeError, match="apply_repetition_penalties_"):
        run_vllm_penalties(logits, prompt, output, *PARAMS)


def test_patch_fixes_it_and_matches_the_reference(npu_like_is_cuda):
    reg = PatchRegistry([REPETITION_PENALTY_TORCH])
    reg.apply("worker", environ={})
    try:
        for seed in range(3):
            logits, prompt, output = inputs(seed)
            got = run_vllm_penalties(logits, prompt, output, *PARAMS)
            torch.testing.assert_close(got, reference(logits, prompt, output, *PARAMS), rtol=1e-6, atol=1e-6)
    finally:
        reg.revert()
    logits, prompt, output = inputs()
    with pytest.raises(AttributeError):  # reverted: back to vLLM's behaviour
        run_vllm_penalties(logits, prompt, output, *PARAMS)


def test_patch_is_in_place_like_the_original():
    import vllm._custom_ops as ops

    reg = PatchRegistry([REPETITION_PENALTY_TORCH])
    reg.apply("worker", environ={})
    try:
        logits = torch.tensor([[2.0, -2.0, 1.0]])
        mask = torch.tensor([[True, True, False]])
        assert ops.apply_repetition_penalties(logits, mask, torch.zeros_like(mask), torch.tensor([2.0])) is None
        assert logits.tolist() == [[1.0, -4.0, 1.0]]
    finally:
        reg.revert()
