# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve`` of a tiny Qwen2.5-VL on the emulated device (127.0.0.1, npu-models' override with the NPU vision
attention on the reference twins): OpenAI chat completions with ``image_url`` content (PNG data: URIs, tests have no
network) and ``video_url`` content (a ``data:video/jpeg`` frame list, vLLM's data-URI video form) return the greedy
tokens of offline generation; bad multimodal input gets vLLM's clear 400 errors and the server keeps serving.

Offline generation of this checkpoint equals HF transformers token for token (test_qwen2_5_vl_engine.py), so HF
greedy on the same chat prompt and the same decoded pixels is the reference here, which keeps this module to one
engine. The image-for-a-text-only-model case is in test_serve.py (its text-only server)."""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.error
import urllib.request
from typing import Any

import pytest
from npu_testkit.engine import emulated_env
from npu_testkit.serve import vllm_server
from npu_testkit.vl_models import (
    build_tiny_vl_model,
    chat_prompt,
    hf_vl_greedy,
    synthetic_image,
    synthetic_video,
    text_token_ids,
    tiny_vl_config,
)

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
FACTOR = 28  # Qwen2.5-VL's merged cell: 14-pixel patches merged 2x2


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _data_uri(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def _jpeg_frames(frames) -> tuple[str, Any]:
    """A ``data:video/jpeg`` URI (base64 JPEG frames joined by commas) and the frames as vLLM decodes them (PIL)."""
    import numpy as np
    from PIL import Image

    encoded, decoded = [], []
    for frame in frames:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=95)
        encoded.append(base64.b64encode(buf.getvalue()).decode())
        decoded.append(np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")))
    return "data:video/jpeg;base64," + ",".join(encoded), np.stack(decoded)


@pytest.fixture(scope="module")
def vl_model():
    return build_tiny_vl_model(tiny_vl_config("qwen2_5_vl"))


@pytest.fixture(scope="module")
def server(vl_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_vl")
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True)}
    args = [
        str(vl_model),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--served-model-name",
        "tiny-vl",
        "--limit-mm-per-prompt",
        json.dumps({"image": 2, "video": 1}),
    ]
    with vllm_server(args, env, tmp / "server.log") as base:
        yield base


def _chat(server: str, vl_model, content: list[dict]) -> tuple[int, dict]:
    return _post(
        f"{server}/v1/chat/completions",
        {
            "model": "tiny-vl",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            # The reference never generates vision special tokens (see hf_vl_greedy); neither may the server.
            "allowed_token_ids": text_token_ids(vl_model),
        },
    )


def _ok(server: str, vl_model) -> list[int]:
    """A text-only chat that must succeed (the server is still serving); returns its tokens."""
    status, out = _chat(server, vl_model, [{"type": "text", "text": "Four score and seven years ago"}])
    assert status == 200, out
    return out["choices"][0]["token_ids"]


def test_chat_with_two_image_urls_matches_offline(server, vl_model):
    small, large = synthetic_image(3 * FACTOR, 2 * FACTOR, seed=1), synthetic_image(5 * FACTOR, 4 * FACTOR, seed=2)
    content = [
        {"type": "image_url", "image_url": {"url": _data_uri(large)}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": _data_uri(small)}},
        {"type": "text", "text": "compare them."},
    ]
    status, out = _chat(server, vl_model, content)
    assert status == 200, out
    request = {
        "prompt": chat_prompt("image", "and", "image", "compare them."),
        "multi_modal_data": {"image": [large, small]},
    }
    ((prompt_ids, expected),) = hf_vl_greedy(vl_model, [request], MAX_TOKENS)
    assert out["prompt_token_ids"] == prompt_ids  # the placeholders expanded to both images' token counts
    assert out["choices"][0]["token_ids"] == expected


def test_chat_with_a_video_url_matches_offline(server, vl_model):
    uri, frames = _jpeg_frames(synthetic_video(4, 3 * FACTOR, 2 * FACTOR, seed=3))
    content = [{"type": "video_url", "video_url": {"url": uri}}, {"type": "text", "text": "What happens here?"}]
    status, out = _chat(server, vl_model, content)
    assert status == 200, out
    request = {"prompt": chat_prompt("video", "What happens here?"), "multi_modal_data": {"video": frames}}
    ((prompt_ids, expected),) = hf_vl_greedy(vl_model, [request], MAX_TOKENS)
    assert out["prompt_token_ids"] == prompt_ids
    assert out["choices"][0]["token_ids"] == expected


def test_too_many_images_is_vllms_error_and_the_server_keeps_serving(server, vl_model):
    before = _ok(server, vl_model)
    image = _data_uri(synthetic_image(2 * FACTOR, 2 * FACTOR, seed=5))
    content = [{"type": "image_url", "image_url": {"url": image}} for _ in range(3)]
    status, out = _chat(server, vl_model, [*content, {"type": "text", "text": "Three?"}])
    assert status == 400, out
    assert "At most 2 image(s) may be provided in one prompt" in out["error"]["message"], out
    assert _ok(server, vl_model) == before


def test_a_corrupt_image_is_vllms_error_and_the_server_keeps_serving(server, vl_model):
    before = _ok(server, vl_model)
    garbage = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n this is not a PNG").decode()
    content = [{"type": "image_url", "image_url": {"url": garbage}}, {"type": "text", "text": "What is it?"}]
    status, out = _chat(server, vl_model, content)
    assert status == 400, out
    assert "cannot identify image file" in out["error"]["message"], out
    assert _ok(server, vl_model) == before
