# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve`` of a tiny Qwen2.5-Omni thinker on the emulated device (127.0.0.1, npu-models' override: vision tower
and audio encoder on the NPU kernels' reference twins): an OpenAI chat with two ``image_url`` parts (PNG data URIs;
tests have no network) returns HF's greedy tokens for the same chat prompt and pixels, and so does a chat with an
``input_audio`` part (a WAV, decoded by vLLM through librosa: the dev group installs it with ``npu-models[audio]``;
without it that test fails naming the fix, because vLLM would answer HTTP 500 "Please install vllm[audio]"); bad
input gets a clear 400 and the server keeps serving (a corrupt image, more images than ``--limit-mm-per-prompt``, a
disabled modality).

Offline generation of this checkpoint equals HF token for token for every modality (test_qwen2_5_omni_engine.py);
HF on the chat prompt is the reference here, which keeps this module to one engine."""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.error
import urllib.request

import pytest
from npu_testkit.engine import emulated_env
from npu_testkit.omni_models import (
    SAMPLING_RATE,
    build_tiny_omni_model,
    hf_omni_greedy,
    omni_prompt,
    omni_token_ids,
    synthetic_audio,
)
from npu_testkit.serve import vllm_server
from npu_testkit.vl_models import synthetic_image

pytestmark = pytest.mark.engine

MAX_TOKENS = 12


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _data_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


@pytest.fixture(scope="module")
def omni_model():
    return build_tiny_omni_model()


@pytest.fixture(scope="module")
def server(omni_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_omni")
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True)}
    args = [
        str(omni_model),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--served-model-name",
        "tiny-omni",
        "--limit-mm-per-prompt",
        json.dumps({"image": 2, "video": 0, "audio": 1}),
    ]
    with vllm_server(args, env, tmp / "server.log") as base:
        yield base


def _chat(server: str, omni_model, content: list[dict]) -> tuple[int, dict]:
    return _post(
        f"{server}/v1/chat/completions",
        {
            "model": "tiny-omni",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "allowed_token_ids": omni_token_ids(omni_model),
        },
    )


def _ok(server: str, omni_model) -> list[int]:
    """A text-only chat that must succeed (the server is still serving); returns its tokens."""
    status, out = _chat(server, omni_model, [{"type": "text", "text": "Four score and seven years ago"}])
    assert status == 200, out
    return out["choices"][0]["token_ids"]


def test_chat_with_two_image_urls_matches_hf(server, omni_model):
    small, large = synthetic_image(84, 56, seed=1), synthetic_image(140, 112, seed=2)
    content = [
        {"type": "image_url", "image_url": {"url": _data_uri(large)}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": _data_uri(small)}},
        {"type": "text", "text": "compare them."},
    ]
    status, out = _chat(server, omni_model, content)
    assert status == 200, out
    request = {
        "prompt": omni_prompt("image", "and", "image", "compare them."),
        "multi_modal_data": {"image": [large, small]},
    }
    ((prompt_ids, expected),) = hf_omni_greedy(omni_model, [request], MAX_TOKENS)
    assert out["prompt_token_ids"] == prompt_ids
    assert out["choices"][0]["token_ids"] == expected


def test_chat_with_input_audio_matches_hf(server, omni_model):
    import importlib.util

    if importlib.util.find_spec("librosa") is None:
        pytest.fail(
            "librosa is not installed, so vLLM answers input_audio with HTTP 500 'Please install vllm[audio]': the "
            "dev group installs it through npu-models[audio] (run `uv sync`; after a pyproject change, `uv lock` first)"
        )
    import numpy as np
    import soundfile

    speech = synthetic_audio(1.0, seed=1)
    buf = io.BytesIO()
    soundfile.write(buf, speech, SAMPLING_RATE, format="WAV", subtype="FLOAT")  # lossless: the same floats come back
    wav = base64.b64encode(buf.getvalue()).decode()
    content = [
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        {"type": "text", "text": "What is said?"},
    ]
    status, out = _chat(server, omni_model, content)
    assert status == 200, out
    decoded, rate = soundfile.read(io.BytesIO(buf.getvalue()), dtype="float32")
    assert rate == SAMPLING_RATE and np.array_equal(decoded, speech)
    request = {"prompt": omni_prompt("audio", "What is said?"), "multi_modal_data": {"audio": speech}}
    ((prompt_ids, expected),) = hf_omni_greedy(omni_model, [request], MAX_TOKENS)
    assert out["prompt_token_ids"] == prompt_ids
    assert out["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize(
    ("case", "status", "message"),
    [
        ("corrupt", 400, "cannot identify image file"),
        ("too_many", 400, "At most 2 image(s) may be provided in one prompt"),
        ("disabled_video", 400, "At most 0 video(s) may be provided in one prompt"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_server_keeps_serving(server, omni_model, case, status, message):
    before = _ok(server, omni_model)
    image = {"type": "image_url", "image_url": {"url": _data_uri(synthetic_image(56, 56, seed=5))}}
    content = {
        "corrupt": [
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n nope").decode()},
            }
        ],
        "too_many": [image, image, image],
        "disabled_video": [{"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,AAAA"}}],
    }[case]
    got, out = _chat(server, omni_model, [*content, {"type": "text", "text": "What is it?"}])
    assert got == status, out
    assert message in out["error"]["message"], out
    assert _ok(server, omni_model) == before
