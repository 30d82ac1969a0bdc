# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The shared cases of the Qwen VL engine tests (one test module per architecture binds them to its engine).

A module loads this file with ``npu_testkit.sibling.import_sibling`` and calls :func:`install` with its
architecture (a key of :data:`ARCHITECTURES`): that defines the module-scoped fixtures (``vl_model`` the tiny
checkpoint dir, ``llm`` its engine built with :data:`ENGINE_ARGS`, ``architecture`` the vLLM class name expected,
``image_factor`` the pixels of one merged cell, ``vl_requests`` the mixed batch) and binds the ``test_*`` functions
below into the module, so pytest collects them there with that module's one engine.

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

#: The vLLM model class (last dotted name) each :func:`npu_testkit.vl_models.tiny_vl_config` name must load as.
ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
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


def test_vllm_model_class_on_our_platform(llm, architecture):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["platform"] == "vllm_npu.platform.platform.EmulatedNPUPlatform"
    assert info["model_runner"] == "vllm_npu.platform.model_runner.NPUModelRunner"
    assert info["attention_backends"] == ["vllm_npu.attention.backends.gqa.AscendAttentionBackend"]
    # vLLM's own model class (no VL override in npu-models yet); its MRoPE runs through our MRotaryEmbedding op.
    (cls,) = llm.collective_rpc(_model_class)
    assert cls.startswith("vllm.model_executor.models.") and cls.endswith(f".{architecture}"), cls
    assert info["plugin_modules"].get("NPUMRotaryEmbedding", 0) >= 1, info["plugin_modules"]
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
        {f.__name__: f for f in (_architecture, _image_factor, _vl_requests, _vl_model, _llm)},
        test_vllm_model_class_on_our_platform=test_vllm_model_class_on_our_platform,
        test_images_video_and_text_in_one_batch_match_hf=test_images_video_and_text_in_one_batch_match_hf,
        test_prefix_cache_hits_only_for_the_same_image=test_prefix_cache_hits_only_for_the_same_image,
    )
