# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, a tiny InternVL2.5 as users serve it: the hub's remote-code layout
(``InternVLChatModel``, ``model_type: internvl_chat``, config class loaded through ``trust_remote_code`` from the
checkpoint dir, InternViT with a fused ``qkv``, ``mlp1`` projector, Qwen2 language model), through npu-models'
override (``AscendInternVLChatModel``: InternViT's attention on the shared encoder seam, reference twin), float32,
with vLLM's own ``InternVLProcessor`` (``<image>`` placeholders, dynamic tiling with a thumbnail).

The checkpoint is converted from a tiny transformers-format InternVL (:mod:`npu_testkit.internvl_models`), which is
the HF reference: one batch of text + image at two sizes (1 tile; 4 tiles + thumbnail), two images in one prompt and
text only. Prompt ids == transformers' ``InternVLProcessor`` ids; greedy == the transformers model's greedy fed the
same pixel values (the hub's preprocessing, which vLLM re-implements, resizes with PIL and transformers' GOT-OCR2
processor with torch: the tiles agree in count and order, their pixels differ by up to 0.5 after normalisation)."""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine
from npu_testkit.internvl_models import (
    build_tiny_internvl_chat_model,
    build_tiny_internvl_hf_model,
    hf_internvl_greedy,
    hf_prompt,
    internvl_chat_prompt,
)
from npu_testkit.mm_models import special_ids
from npu_testkit.vl_models import synthetic_image

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
#: 50x60 fits one 56-pixel tile (no thumbnail); 200x150 is cut into 2x2 tiles plus a thumbnail.
SMALL, LARGE = (50, 60), (200, 150)


@pytest.fixture(scope="module")
def models():
    hf_dir = build_tiny_internvl_hf_model()
    return hf_dir, build_tiny_internvl_chat_model(hf_dir)


@pytest.fixture(scope="module")
def llm(models, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("internvl-chat"))
    _, chat_dir = models
    with engine(
        chat_dir, env, trust_remote_code=True, max_num_batched_tokens=64, limit_mm_per_prompt={"image": 2}
    ) as llm:
        yield llm


def _encoder(worker) -> dict[str, object]:
    from vllm_npu.models.encoder_attention import AscendMultiHeadAttention

    model = worker.model_runner.get_model()
    attns = [m for m in model.modules() if isinstance(m, AscendMultiHeadAttention)]
    return {"model": f"{type(model).__module__}.{type(model).__qualname__}", "calls": [a.npu_calls for a in attns]}


def test_remote_code_internvl_images_of_two_sizes_and_text_match_hf(llm, models):
    import torch
    import transformers
    from vllm import SamplingParams
    from vllm.model_executor.models.internvl import InternVLProcessor

    hf_dir, chat_dir = models
    (before,) = llm.collective_rpc(_encoder)
    assert before["model"] == "vllm_npu.models.multimodal.AscendInternVLChatModel"
    assert len(before["calls"]) == 2  # both InternViT layers on the seam

    small, large = synthetic_image(*SMALL, seed=1), synthetic_image(*LARGE, seed=2)
    cases = [
        (("image", "What is in the picture?"), [small]),
        (("image", "Describe this image."), [large]),
        (("image", "image", "Compare them, please."), [large, small]),
        (("Four score and seven years ago",), []),
    ]
    requests = [
        {"prompt": internvl_chat_prompt(*parts), **({"multi_modal_data": {"image": imgs}} if imgs else {})}
        for parts, imgs in cases
    ]

    # The reference: transformers' processor for the ids, the hub preprocessing (vLLM's processor) for the pixels.
    hf_processor = transformers.AutoProcessor.from_pretrained(hf_dir)
    chat_config = transformers.AutoConfig.from_pretrained(chat_dir, trust_remote_code=True)
    chat_processor = InternVLProcessor(chat_config, transformers.AutoTokenizer.from_pretrained(chat_dir))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    rendered = transformers.AutoTokenizer.from_pretrained(chat_dir).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert rendered == requests[0]["prompt"]  # the checkpoint's chat template writes vLLM's <image> placeholder
    reference = []
    for parts, imgs in cases:
        hf_inputs = hf_processor(text=[hf_prompt(*parts)], images=imgs or None, return_tensors="pt")
        pixels = chat_processor(text="", images=imgs, return_tensors="pt").get("pixel_values_flat")
        if imgs:
            assert pixels.shape == hf_inputs["pixel_values"].shape  # same tiles, same order
        reference.append((hf_inputs["input_ids"][0].tolist(), pixels))
    model = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    banned = special_ids(hf_dir)
    expected = hf_internvl_greedy(model, reference, MAX_TOKENS, banned)

    allowed = [i for i in range(model.config.text_config.vocab_size) if i not in banned]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outputs] == [ids for ids, _ in reference]
    image_id = model.config.image_token_id
    counts = [ids.count(image_id) for ids, _ in reference]
    assert counts == [4, 20, 24, 0], counts  # 4 tokens per tile: 1 tile; 4 tiles + thumbnail; both
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    (after,) = llm.collective_rpc(_encoder)
    assert all(a > b for a, b in zip(after["calls"], before["calls"])), (before, after)
