# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, a tiny Gemma-3 (``Gemma3ForConditionalGeneration``) through npu-models' override
(``vllm_npu.models.multimodal``: the SigLIP tower's attention on the shared encoder seam, reference twin), float32,
with the real ``Gemma3Processor``: text + image at two sizes (each resized to the tower's 56x56, 4 tokens), two
images in one prompt, and text only, in one batch; the text model alternates a sliding-window layer (window 24,
shorter than the prompts) and a global one. Prompt ids == HF's processor, greedy == HF; the multimodal embedding
merge runs npu-patches' ``multimodal-merge-index-put``.

The reference runs HF without ``token_type_ids``, i.e. image tokens attend causally: vLLM 0.11's V1 engine builds the
inputs embeddings in the model runner, so ``Gemma3ForConditionalGeneration.forward`` never builds the bidirectional
image masks (``prepare_attn_masks`` is on its V0-only branch) — a vLLM property, the same on any platform."""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine
from npu_testkit.mm_models import build_tiny_gemma3_model, gemma3_prompt, hf_mm_greedy, special_ids
from npu_testkit.vl_models import synthetic_image

pytestmark = pytest.mark.engine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gemma3_model():
    return build_tiny_gemma3_model()


@pytest.fixture(scope="module")
def llm(gemma3_model, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("gemma3"))
    with engine(gemma3_model, env, max_num_batched_tokens=32, limit_mm_per_prompt={"image": 2}) as llm:
        yield llm


def _encoder(worker) -> dict[str, object]:
    model = worker.model_runner.get_model()
    layers = model.vision_tower.vision_model.encoder.layers
    return {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "attention": [(type(layer.self_attn.attn).__qualname__, layer.self_attn.attn.npu_calls) for layer in layers],
    }


def _merge_is_patched(worker) -> bool:
    """npu-patches' multimodal-merge-index-put is live in the worker (its replacement wraps vLLM's merge)."""
    from vllm.model_executor.models import utils

    return hasattr(utils._merge_multimodal_embeddings, "__wrapped__")


def test_images_of_two_sizes_and_text_match_hf(llm, gemma3_model):
    import torch
    import transformers
    from vllm import SamplingParams

    (before,) = llm.collective_rpc(_encoder)
    assert before["model"] == "vllm_npu.models.multimodal.AscendGemma3ForConditionalGeneration"
    assert [c for c, _ in before["attention"]] == ["AscendMultiHeadAttention"] * 2
    assert llm.llm_engine.model_config.hf_text_config.sliding_window == 24
    assert llm.collective_rpc(_merge_is_patched) == [True]  # the merge below runs as index_put_

    small, large = synthetic_image(84, 56, seed=1), synthetic_image(200, 150, seed=2)
    requests = [
        {"prompt": gemma3_prompt("image", "What is in the picture?"), "multi_modal_data": {"image": small}},
        {"prompt": gemma3_prompt("image", "Describe this image, please."), "multi_modal_data": {"image": large}},
        {
            "prompt": gemma3_prompt("image", "and", "image", "compare them, please, in some detail."),
            "multi_modal_data": {"image": [large, small]},
        },
        {"prompt": gemma3_prompt("Four score and seven years ago our fathers brought forth")},
    ]
    processor = transformers.AutoProcessor.from_pretrained(gemma3_model)
    model = transformers.AutoModelForImageTextToText.from_pretrained(gemma3_model, dtype=torch.float32).eval()
    banned = special_ids(gemma3_model)
    expected = hf_mm_greedy(model, processor, requests, MAX_TOKENS, banned, drop=("token_type_ids",))
    allowed = [i for i in range(model.config.text_config.vocab_size) if i not in banned]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outputs] == [p for p, _ in expected]
    assert max(len(p) for p, _ in expected) > 24  # past the sliding window
    assert [list(o.outputs[0].token_ids) for o in outputs] == [g for _, g in expected]
    (after,) = llm.collective_rpc(_encoder)
    assert all(calls > before_calls for (_, calls), (_, before_calls) in zip(after["attention"], before["attention"]))
