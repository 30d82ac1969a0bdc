# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, a tiny MiniCPM-V 2.6 (``MiniCPMV`` -> vLLM's ``MiniCPMV2_6``) through
npu-models' override (``vllm_npu.models.multimodal.AscendMiniCPMV``: the Idefics2/SigLIP navit tower's attention on
the shared encoder seam, reference twin), float32, built on the fly without the hub: the checkpoint carries its own
remote code (config, image processor with LLaVA-UHD slicing, processor; ``trust_remote_code``), see
``npu_testkit.minicpmv_models``. One batch: an unsliced image, a sliced one (source + 2x2 slices), both in one prompt,
a 3-frame video (frames as unsliced images without ids, MiniCPM-V 2.6's convention) and text only. The small image comes back at another index in the two-image prompt, so vLLM's processor cache
renumbers its cached ``<image_id>`` (``_recompute_cached_prompt_update``); the sliced image's 3x5-patch slices share
an encoder batch with the 4x4 one, so the tower's padding mask matters. Prompt ids == the checkpoint processor's,
greedy == the reference model (transformers' ``Idefics2VisionTransformer`` + ``Qwen2ForCausalLM`` + a plain-torch
resampler, same weights)."""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine
from npu_testkit.minicpmv_models import build_tiny_minicpmv_model, minicpmv_prompt, reference_greedy
from npu_testkit.mm_models import special_ids
from npu_testkit.vl_models import synthetic_image, synthetic_video

pytestmark = pytest.mark.engine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def minicpmv_model():
    return build_tiny_minicpmv_model()


@pytest.fixture(scope="module")
def llm(minicpmv_model, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("minicpmv"))
    with engine(
        minicpmv_model,
        env,
        trust_remote_code=True,
        max_num_batched_tokens=128,
        limit_mm_per_prompt={"image": 2, "video": 1},
    ) as llm:
        yield llm


def _encoder(worker) -> dict[str, object]:
    from vllm_npu.models.encoder_attention import AscendMultiHeadAttention

    model = worker.model_runner.get_model()
    attns = [m for m in model.modules() if isinstance(m, AscendMultiHeadAttention)]
    return {"model": type(model).__name__, "tower": type(model.vpm).__name__, "calls": [a.npu_calls for a in attns]}


def test_images_video_and_text_match_the_reference(llm, minicpmv_model):
    import transformers
    from vllm import SamplingParams

    (before,) = llm.collective_rpc(_encoder)
    assert before["model"] == "MiniCPMV2_6"
    assert before["tower"] == "AscendIdefics2VisionTransformer"  # padded slices masked
    assert len(before["calls"]) == 2  # both navit layers converted

    small, large = synthetic_image(50, 40, seed=1), synthetic_image(120, 80, seed=2)
    requests = [
        {"prompt": minicpmv_prompt("image", "What is in the picture?"), "multi_modal_data": {"image": small}},
        {"prompt": minicpmv_prompt("image", "Describe this image."), "multi_modal_data": {"image": large}},
        {
            "prompt": minicpmv_prompt("image", "image", "Compare them, please."),
            "multi_modal_data": {"image": [large, small]},
        },
        {
            "prompt": minicpmv_prompt("video", "What happens?"),
            "multi_modal_data": {"video": synthetic_video(3, 70, 56)},
        },
        {"prompt": minicpmv_prompt("Four score and seven years ago")},
    ]
    banned = special_ids(minicpmv_model)
    expected = reference_greedy(minicpmv_model, requests, MAX_TOKENS, banned)
    config = transformers.AutoConfig.from_pretrained(minicpmv_model, trust_remote_code=True)
    allowed = [i for i in range(config.vocab_size) if i not in banned]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outputs] == [p for p, _ in expected]
    tok = transformers.AutoTokenizer.from_pretrained(minicpmv_model)
    slices = [p.count(tok.convert_tokens_to_ids("<slice>")) for p, _ in expected]
    assert slices == [0, 4, 4, 0, 0], slices  # the large image is sliced 2x2, the small one and the frames not
    assert expected[3][0].count(tok.convert_tokens_to_ids("<image>")) == 3  # one unsliced image per frame
    assert [list(o.outputs[0].token_ids) for o in outputs] == [g for _, g in expected]
    (after,) = llm.collective_rpc(_encoder)
    assert all(a > b for a, b in zip(after["calls"], before["calls"])), (before, after)
