# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, a tiny Qwen2.5-Omni thinker through npu-models' override
(``vllm_npu.models.multimodal``: the Qwen2.5-VL vision tower on ``vllm_npu.models.vision`` with its head dim 80
padded to 128, the audio encoder on the shared encoder seam; all on the kernels' reference twins), float32, with
vLLM's Omni processor over the real HF processor (Qwen2-VL image/video processors, Whisper feature extractor).

One batch mixes text + image (two sizes), text + audio, image + audio in one prompt, a video, and text only; greedy
== HF's thinker (full forward per step), prompt ids == HF's processor (so the TMRoPE positions vLLM computes on the
host, ``MRotaryEmbedding._omni_get_input_positions_tensor``, rotate through npu-ops' MRoPE override against HF's
``get_rope_index``). Chunked prefill at 32 tokens splits the long prompts inside their items."""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine
from npu_testkit.omni_models import build_tiny_omni_model, hf_omni_greedy, omni_prompt, omni_token_ids, synthetic_audio
from npu_testkit.vl_models import synthetic_image, synthetic_video

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
ENGINE_ARGS = {
    "max_num_batched_tokens": 32,
    "enable_prefix_caching": True,
    "limit_mm_per_prompt": {"image": 2, "video": 1, "audio": 1},
}


@pytest.fixture(scope="module")
def omni_model():
    return build_tiny_omni_model()


@pytest.fixture(scope="module")
def llm(omni_model, tmp_path_factory):
    with engine(omni_model, emulated_env(tmp_path_factory.mktemp("omni")), **ENGINE_ARGS) as llm:
        yield llm


def _generate(llm, requests):
    from vllm import SamplingParams

    allowed = omni_token_ids(llm.llm_engine.model_config.model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    return llm.generate(requests, params, use_tqdm=False)


def _encoders(worker) -> dict[str, object]:
    model = worker.model_runner.get_model()
    blocks = model.visual.blocks
    return {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "vision": [(type(b.attn).__qualname__, b.attn.npu_head_dim, b.attn.npu_calls) for b in blocks],
        "audio_attention": model.audio_tower.config._attn_implementation,
    }


def _kernel_calls(worker) -> int:
    """How many audio-encoder attention calls went through the seam since the last read (a spy on the kernel)."""
    from vllm_npu.models import encoder_attention

    calls = getattr(encoder_attention, "_test_calls", None)
    if calls is None:
        real = encoder_attention.attend_packed
        calls = encoder_attention._test_calls = []

        def spy(*args, **kwargs):
            calls.append(args[3])
            return real(*args, **kwargs)

        encoder_attention.attend_packed = spy
    n = len(calls)
    calls.clear()
    return n


def test_mixed_modalities_in_one_batch_match_hf(llm, omni_model):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["platform"] == "vllm_npu.platform.platform.EmulatedNPUPlatform"
    assert info["plugin_modules"].get("NPUMRotaryEmbedding", 0) >= 1, info["plugin_modules"]
    (before,) = llm.collective_rpc(_encoders)
    assert before["model"] == "vllm_npu.models.multimodal.AscendQwen2_5OmniThinkerForConditionalGeneration"
    assert [(c, d) for c, d, _ in before["vision"]] == [("AscendQwen2_5_VisionAttention", 128)] * 3
    assert before["audio_attention"] == "npu_encoder"
    llm.collective_rpc(_kernel_calls)  # install the spy

    small, large = synthetic_image(84, 56, seed=1), synthetic_image(140, 112, seed=2)
    clip = synthetic_video(4, 84, 56, seed=3)
    # Waveforms at the processor's 16 kHz given without a rate: vLLM resamples any (rate-tagged) audio through
    # librosa, which is vLLM's optional ``audio`` extra and not installed here.
    speech, tone = synthetic_audio(1.0, seed=1), synthetic_audio(0.6, seed=2)
    requests = [
        {"prompt": omni_prompt("image", "What is in the picture?"), "multi_modal_data": {"image": small}},
        {"prompt": omni_prompt("image", "Describe this image."), "multi_modal_data": {"image": large}},
        {"prompt": omni_prompt("audio", "What is said?"), "multi_modal_data": {"audio": speech}},
        {
            "prompt": omni_prompt("image", "and", "audio", "match them, please."),
            "multi_modal_data": {"image": small, "audio": tone},
        },
        {"prompt": omni_prompt("video", "What happens here?"), "multi_modal_data": {"video": clip}},
        {"prompt": omni_prompt("Four score and seven years ago")},
    ]
    expected = hf_omni_greedy(omni_model, requests, MAX_TOKENS)
    outputs = _generate(llm, requests)
    assert [list(o.prompt_token_ids) for o in outputs] == [p for p, _ in expected]
    assert [list(o.outputs[0].token_ids) for o in outputs] == [g for _, g in expected]
    (after,) = llm.collective_rpc(_encoders)
    assert all(calls >= 2 for _, _, calls in after["vision"]), after  # the images and the video, not only profiling
    (audio_calls,) = llm.collective_rpc(_kernel_calls)
    assert audio_calls >= 2 * 2, audio_calls  # two audios through both audio layers


def test_audio_in_video_is_refused_by_name_and_the_engine_serves_on(llm, omni_model):
    """``use_audio_in_video`` (the video's audio interleaved with its frames): HF's processor and thinker take it
    offline, vLLM 0.11's V1 engine does not (no overlapping placeholders: an AssertionError in its processor, or with
    the processor cache off an IndexError in the worker's MRoPE positions that kills the engine), so the override's
    processor refuses it by name first."""
    clip, speech = synthetic_video(4, 84, 56, seed=3), synthetic_audio(1.0, seed=1)
    request = {
        "prompt": omni_prompt("video", "What happens here?"),
        "multi_modal_data": {"video": clip, "audio": speech},
        "mm_processor_kwargs": {"use_audio_in_video": True},
    }
    with pytest.raises(ValueError, match="use_audio_in_video=True is not supported for Qwen2.5-Omni on vLLM 0.11"):
        _generate(llm, [request])
    text = {"prompt": omni_prompt("Four score and seven years ago")}
    (expected,) = hf_omni_greedy(omni_model, [text], MAX_TOKENS)
    (out,) = _generate(llm, [text])
    assert list(out.outputs[0].token_ids) == expected[1]
