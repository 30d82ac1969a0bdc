# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, a tiny InternVL in transformers' format (``InternVLForConditionalGeneration``,
which vLLM 0.11 serves with its InternS1 class) through npu-models' override (``vllm_npu.models.multimodal``: the
InternViT tower's attention on the shared encoder seam, reference twin), float32, with the real ``InternVLProcessor``
(GOT-OCR2 image processor, dynamic tiling): text + image at two sizes (1 tile, and 4 tiles + a thumbnail), two
images in one prompt, and text only, in one batch. Prompt ids == HF's processor, greedy == HF.

The remote-code InternVL2 / InternVL2.5 layout (``InternVLChatModel``, ``trust_remote_code``) is served in
test_internvl_chat_engine.py, from a checkpoint converted from this format's model."""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine
from npu_testkit.mm_models import build_tiny_internvl_model, hf_mm_greedy, internvl_prompt, special_ids
from npu_testkit.vl_models import synthetic_image

pytestmark = pytest.mark.engine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def internvl_model():
    return build_tiny_internvl_model()


@pytest.fixture(scope="module")
def llm(internvl_model, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("internvl"))
    with engine(internvl_model, env, max_num_batched_tokens=64, limit_mm_per_prompt={"image": 2, "video": 0}) as llm:
        yield llm


def _encoder(worker) -> dict[str, object]:
    from vllm_npu.models.encoder_attention import AscendMultiHeadAttention

    model = worker.model_runner.get_model()
    attns = [m for m in model.modules() if isinstance(m, AscendMultiHeadAttention)]
    return {"model": f"{type(model).__module__}.{type(model).__qualname__}", "calls": [a.npu_calls for a in attns]}


def test_images_of_two_sizes_and_text_match_hf(llm, internvl_model):
    import torch
    import transformers
    from vllm import SamplingParams

    (before,) = llm.collective_rpc(_encoder)
    assert before["model"] == "vllm_npu.models.multimodal.AscendInternS1ForConditionalGeneration"
    assert len(before["calls"]) == 2  # both InternViT layers converted

    small, large = synthetic_image(84, 56, seed=1), synthetic_image(200, 150, seed=2)
    requests = [
        {"prompt": internvl_prompt("image", "What is in the picture?"), "multi_modal_data": {"image": small}},
        {"prompt": internvl_prompt("image", "Describe this image."), "multi_modal_data": {"image": large}},
        {
            "prompt": internvl_prompt("image", "image", "Compare them, please."),
            "multi_modal_data": {"image": [large, small]},
        },
        {"prompt": internvl_prompt("Four score and seven years ago")},
    ]
    processor = transformers.AutoProcessor.from_pretrained(internvl_model)
    model = transformers.AutoModelForImageTextToText.from_pretrained(internvl_model, dtype=torch.float32).eval()
    banned = special_ids(internvl_model)
    expected = hf_mm_greedy(model, processor, requests, MAX_TOKENS, banned)
    allowed = [i for i in range(model.config.text_config.vocab_size) if i not in banned]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outputs] == [p for p, _ in expected]
    image_id = model.config.image_token_id
    counts = [p.count(image_id) for p, _ in expected]
    assert counts[0] < counts[1] and counts[3] == 0, counts  # one tile vs several
    assert [list(o.outputs[0].token_ids) for o in outputs] == [g for _, g in expected]
    (after,) = llm.collective_rpc(_encoder)
    assert all(a > b for a, b in zip(after["calls"], before["calls"])), (before, after)
