# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The shared cases of the Qwen VL engine tests (one test module per architecture binds them to its engine).

A module loads this file with ``npu_testkit.sibling.import_sibling`` and calls :func:`install` with its
architecture (a key of :data:`ARCHITECTURES`): that defines the module-scoped fixtures (``vl_model`` the tiny
checkpoint dir, ``llm`` its engine built with :data:`ENGINE_ARGS`, ``architecture`` the vLLM class name expected,
``image_factor`` the pixels of one merged cell, ``vl_requests`` the mixed batch) and binds the ``test_*`` functions
below into the module, so pytest collects them there with that module's one engine.

The engine builds npu-models' override of each architecture (``vllm_npu.models.qwen_vl``): vLLM's class with the
vision attention on the NPU kernels' reference twins (vision rotary ``rotary_mul_qk``, ``vision_attention``), and
for Qwen2-VL / Qwen2.5-VL the vision head dim 80 padded to 128 after load. So the HF comparisons below are the
overrides' correctness tests; the tests assert that the override classes are the ones built and that their
attention ran.

The engine runs with chunked prefill (32-token steps, smaller than the mixed prompt and than the largest image, so
prefill stops inside a multimodal item and the encoder cache carries it over) and prefix caching on. Reference: HF
transformers float32, greedy, one request at a time, from the same checkpoint and processor.
"""

from __future__ import annotations

from typing import Any

import pytest
from npu_testkit.engine import emulated_env, engine
from npu_testkit.vl_models import (
    build_tiny_vl_model,
    chat_prompt,
    hf_vl_greedy,
    mixed_vl_requests,
    synthetic_image,
    text_token_ids,
    tiny_vl_config,
)

#: The vLLM architecture each :func:`npu_testkit.vl_models.tiny_vl_config` name is (npu-models overrides each one as
#: ``vllm_npu.models.qwen_vl:Ascend<architecture>``).
ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
#: The vision attention class of each override and the head dim its kernels see (80 padded to 128 for Qwen2/2.5).
VISION_ATTENTION = {
    "qwen2_vl": ("vllm_npu.models.vision.AscendQwen2VisionAttention", 128),
    "qwen2_5_vl": ("vllm_npu.models.vision.AscendQwen2_5_VisionAttention", 128),
    "qwen3_vl": ("vllm_npu.models.vision.AscendQwen2_5_VisionAttention", 16),
    "qwen3_vl_moe": ("vllm_npu.models.vision.AscendQwen2_5_VisionAttention", 16),
}
MAX_TOKENS = 16
MAX_BATCHED_TOKENS = 32
ENGINE_ARGS = {
    "max_num_batched_tokens": MAX_BATCHED_TOKENS,
    "enable_prefix_caching": True,
    "limit_mm_per_prompt": {"image": 2, "video": 1},
}


def _generate(llm, requests, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    # The reference never generates vision special tokens (see hf_vl_greedy); neither may vLLM.
    allowed = text_token_ids(llm.llm_engine.model_config.model)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, allowed_token_ids=allowed)
    return llm.generate(requests, params, use_tqdm=False)


def _model_class(worker) -> str:
    model = worker.model_runner.get_model()
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _vision_attention(worker) -> list[tuple[str, int, int]]:
    """(class, head dim the kernels see, forward calls so far) of each vision block's attention."""
    blocks = worker.model_runner.get_model().visual.blocks
    return [
        (f"{type(b.attn).__module__}.{type(b.attn).__qualname__}", b.attn.npu_head_dim, b.attn.npu_calls)
        for b in blocks
    ]


def test_override_model_class_on_our_platform(llm, architecture, vision_attention):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["platform"] == "vllm_npu.platform.platform.EmulatedNPUPlatform"
    assert info["model_runner"] == "vllm_npu.platform.model_runner.NPUModelRunner"
    assert info["attention_backends"] == ["vllm_npu.attention.backends.gqa.AscendAttentionBackend"]
    assert info["kernel_backend"] == "reference"
    # npu-models' override of vLLM's class; its MRoPE runs through our MRotaryEmbedding op.
    (cls,) = llm.collective_rpc(_model_class)
    assert cls == f"vllm_npu.models.qwen_vl.Ascend{architecture}", cls
    assert info["plugin_modules"].get("NPUMRotaryEmbedding", 0) >= 1, info["plugin_modules"]
    (attns,) = llm.collective_rpc(_vision_attention)
    assert [(c, d) for c, d, _ in attns] == [vision_attention] * len(attns) and attns, attns
    config = llm.llm_engine.vllm_config
    assert config.scheduler_config.chunked_prefill_enabled
    assert config.scheduler_config.max_num_batched_tokens == MAX_BATCHED_TOKENS
    assert config.cache_config.enable_prefix_caching


def test_images_video_and_text_in_one_batch_match_hf(llm, vl_model, vl_requests):
    requests = vl_requests
    expected = hf_vl_greedy(vl_model, requests, MAX_TOKENS)
    outputs = _generate(llm, requests)
    # The placeholders expanded to the same token counts (two image sizes, one video) as HF's processor.
    assert [list(o.prompt_token_ids) for o in outputs] == [p for p, _ in expected]
    image_id = llm.llm_engine.model_config.hf_config.image_token_id
    counts = [p.count(image_id) for p, _ in expected]
    assert counts[0] != counts[1] and counts[0] > 0 and counts[3] == 0, counts
    assert [list(o.outputs[0].token_ids) for o in outputs] == [g for _, g in expected]
    # The images and the video went through the override's vision attention (not only the profiling run).
    (after,) = llm.collective_rpc(_vision_attention)
    assert all(calls >= 2 for _, _, calls in after), after


def test_prefix_cache_hits_only_for_the_same_image(llm, vl_model, image_factor):
    text = "Describe every part of this image in great detail, please, from left to right."
    width, height = 5 * image_factor, 4 * image_factor
    first, other = synthetic_image(width, height, seed=20), synthetic_image(width, height, seed=21)
    same = {"prompt": chat_prompt("image", text), "multi_modal_data": {"image": first}}
    different = {"prompt": chat_prompt("image", text), "multi_modal_data": {"image": other}}
    expected = [g for _, g in hf_vl_greedy(vl_model, [same, different], MAX_TOKENS)]

    (warm,) = _generate(llm, [same])
    assert list(warm.outputs[0].token_ids) == expected[0]
    (hit,) = _generate(llm, [same])
    assert list(hit.outputs[0].token_ids) == expected[0]
    assert hit.num_cached_tokens >= 32, hit.num_cached_tokens  # the image's blocks came from the cache
    # Same token ids, different pixels: the image is in the first block, so nothing may be reused.
    (miss,) = _generate(llm, [different])
    assert miss.num_cached_tokens == 0, miss.num_cached_tokens
    assert list(miss.outputs[0].token_ids) == expected[1]


def install(namespace: dict[str, Any], *, arch: str) -> None:
    """Define this suite's fixtures and tests in a test module's ``namespace`` (its ``globals()``) for ``arch``
    (a :func:`npu_testkit.vl_models.tiny_vl_config` name and a key of :data:`ARCHITECTURES`)."""
    if arch not in ARCHITECTURES:
        raise KeyError(
            f"unknown Qwen VL arch {arch!r}: add its vLLM class name to ARCHITECTURES (known: {sorted(ARCHITECTURES)})"
        )
    architecture = ARCHITECTURES[arch]
    config = tiny_vl_config(arch)
    factor = config.vision_config.patch_size * config.vision_config.spatial_merge_size
    qwen3 = arch.startswith("qwen3")  # Qwen3-VL writes frame timestamps into the prompt: videos carry metadata

    @pytest.fixture(scope="module", name="architecture")
    def _architecture() -> str:
        return architecture

    @pytest.fixture(scope="module", name="vision_attention")
    def _vision_attention_expected() -> tuple[str, int]:
        return VISION_ATTENTION[arch]

    @pytest.fixture(scope="module", name="image_factor")
    def _image_factor() -> int:
        return factor

    @pytest.fixture(scope="module", name="vl_requests")
    def _vl_requests() -> list[dict[str, Any]]:
        return mixed_vl_requests(factor=factor, metadata=qwen3)

    @pytest.fixture(scope="module", name="vl_model")
    def _vl_model():
        return build_tiny_vl_model(tiny_vl_config(arch))

    @pytest.fixture(scope="module", name="llm")
    def _llm(vl_model, tmp_path_factory):
        with engine(vl_model, emulated_env(tmp_path_factory.mktemp(arch)), **ENGINE_ARGS) as llm:
            yield llm

    namespace.update(
        {
            f.__name__: f
            for f in (_architecture, _vision_attention_expected, _image_factor, _vl_requests, _vl_model, _llm)
        },
        test_override_model_class_on_our_platform=test_override_model_class_on_our_platform,
        test_images_video_and_text_in_one_batch_match_hf=test_images_video_and_text_in_one_batch_match_hf,
        test_prefix_cache_hits_only_for_the_same_image=test_prefix_cache_hits_only_for_the_same_image,
    )
