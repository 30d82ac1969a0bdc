# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, a tiny Qwen2-Audio (``Qwen2AudioForConditionalGeneration``) through npu-models'
override (``vllm_npu.models.multimodal``: transformers' ``Qwen2AudioEncoder`` with its attention on the shared
encoder seam, reference twin), float32, with the real ``Qwen2AudioProcessor`` (Whisper feature extractor): text +
audio at two lengths, two audios of different lengths in one prompt (the encoder's key-padding mask read back as
lengths), and text only, in one batch. Prompt ids == HF's processor, greedy == HF (full forward per step).

The engine runs in a graph mode: ``cudagraph_mode=PIECEWISE`` (sizes 1/2/4/8): the language model is compiled and
its pieces captured and replayed on the static-graph twin, while the audio encoder runs eagerly (vLLM compiles only
the decoder) and its outputs reach the captured pieces through the encoder cache and the merged embeddings."""

from __future__ import annotations

import pytest
from npu_testkit.graph_e2e import CAPTURE_SIZES, graph_engine, replays, runtime_info
from npu_testkit.mm_models import build_tiny_qwen2_audio_model, hf_mm_greedy, qwen2_audio_prompt, special_ids
from npu_testkit.omni_models import synthetic_audio

pytestmark = pytest.mark.engine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def audio_model():
    return build_tiny_qwen2_audio_model()


@pytest.fixture(scope="module")
def llm(audio_model, tmp_path_factory):
    args = {"max_num_batched_tokens": 32, "limit_mm_per_prompt": {"audio": 2}}
    with graph_engine(audio_model, tmp_path_factory, "qwen2_audio", "PIECEWISE", block_size=16, **args) as llm:
        yield llm


def _seam_calls(worker) -> list[list[int]]:
    """The sequence lengths of every encoder-attention call through the seam since the last read (installs a spy on
    the first call)."""
    from vllm_npu.models import encoder_attention

    calls = getattr(encoder_attention, "_test_calls", None)
    if calls is None:
        real = encoder_attention.attend_packed
        calls = encoder_attention._test_calls = []

        def spy(*args, **kwargs):
            calls.append(list(args[3]))
            return real(*args, **kwargs)

        encoder_attention.attend_packed = spy
    seen = list(calls)
    calls.clear()
    return seen


def _model(worker) -> tuple[str, str]:
    model = worker.model_runner.get_model()
    return f"{type(model).__module__}.{type(model).__qualname__}", model.audio_tower.config._attn_implementation


def test_audio_of_two_lengths_and_text_match_hf(llm, audio_model):
    import torch
    import transformers
    from vllm import SamplingParams

    (model,) = llm.collective_rpc(_model)
    assert model == ("vllm_npu.models.multimodal.AscendQwen2AudioForConditionalGeneration", "npu_encoder")
    llm.collective_rpc(_seam_calls)  # install the spy
    info = runtime_info(llm)
    assert info["cudagraph_mode"] == "PIECEWISE" and info["capture_sizes"] == CAPTURE_SIZES, info
    before = replays(llm, "PIECEWISE")

    # Waveforms at 16 kHz without a rate (vLLM resamples rate-tagged audio through librosa, not installed here).
    long, short = synthetic_audio(1.0, seed=1), synthetic_audio(0.5, seed=2)
    cases = [
        (("audio", "What is said?"), {"audio": long}),
        (("audio", "And here?"), {"audio": short}),
        (("audio", "and", "audio", "compare them."), {"audio": [long, short]}),
        (("Four score and seven years ago",), None),
    ]
    # HF's processor takes the bracketed placeholder, vLLM 0.11 the bare one (see qwen2_audio_prompt): same ids.
    requests = [{"prompt": qwen2_audio_prompt(*parts), "multi_modal_data": media} for parts, media in cases]
    vllm_requests = [
        {"prompt": qwen2_audio_prompt(*parts, brackets=False), **({"multi_modal_data": media} if media else {})}
        for parts, media in cases
    ]
    processor = transformers.AutoProcessor.from_pretrained(audio_model)
    hf = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(audio_model, dtype=torch.float32).eval()
    banned = special_ids(audio_model)
    expected = hf_mm_greedy(hf, processor, requests, MAX_TOKENS, banned)
    allowed = [i for i in range(hf.config.text_config.vocab_size) if i not in banned]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    outputs = llm.generate(vllm_requests, params, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outputs] == [p for p, _ in expected]
    assert [list(o.outputs[0].token_ids) for o in outputs] == [g for _, g in expected]
    assert replays(llm, "PIECEWISE") > before  # the decode steps replayed the captured pieces
    (calls,) = llm.collective_rpc(_seam_calls)
    # The encoder layers ran on the kernel with the audios' own lengths read back from vLLM's padding mask (100 mel
    # frames per second, halved by the stride-2 conv: 50 for 1 s, 25 for 0.5 s), alone or batched.
    lengths = {n for c in calls for n in c}
    assert {50, 25} <= lengths, calls
