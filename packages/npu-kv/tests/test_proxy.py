# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The PD proxy against fake prefill/decode instances (aiohttp servers on 127.0.0.1): the two-step protocol,
streaming, the picking policies, and a prefill instance that cannot be reached."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from aiohttp import web
from vllm_npu.kv.proxy import Pool, create_app, prefill_body


def test_prefill_body() -> None:
    body = {"prompt": "x", "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    out = prefill_body({**body, "max_completion_tokens": 9})
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert body["max_tokens"] == 9  # the client's body is left alone


def test_pools_pick_round_robin_and_least_loaded() -> None:
    rr = Pool(["http://a/", "http://b"])
    assert [rr.pick() for _ in range(3)] == ["http://a", "http://b", "http://a"]
    ll = Pool(["http://a", "http://b"], "least_loaded")
    first, second = ll.pick(), ll.pick()
    assert (first, second) == ("http://a", "http://b")
    ll.release("http://a")
    assert ll.pick() == "http://a"  # a has nothing in flight now
    with pytest.raises(ValueError, match="policy"):
        Pool(["http://a"], "random")


class Fakes:
    """One fake prefill and one fake decode instance recording what they were sent."""

    def __init__(self) -> None:
        self.seen: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}

    async def prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen["prefill"].append(body)
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {"remote_block_ids": [1, 2]}})

    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen["decode"].append(body)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "hello"}], "params": body.get("kv_transfer_params")})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("he", "llo"):
            await resp.write(f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _scenario(prefill_up: bool) -> tuple[Fakes, list[Any]]:
    fakes = Fakes()
    runners = []
    d_runner, d_url = await _serve(fakes.decode)
    runners.append(d_runner)
    if prefill_up:
        p_runner, p_url = await _serve(fakes.prefill)
        runners.append(p_runner)
    else:
        from npu_testkit.serve import free_port

        p_url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    app = create_app([p_url], [d_url], "least_loaded", timeout_s=10)
    results = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        results.append((r.status_code, r.json()))
        r = await client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 5, "stream": True})
        results.append((r.status_code, r.text))
        r = await client.get("/health")
        results.append(r.json())
    for runner in runners:
        await runner.cleanup()
    return fakes, results


def test_two_step_protocol_and_streaming() -> None:
    fakes, (plain, streamed, health) = asyncio.run(_scenario(prefill_up=True))
    assert plain == (200, {"choices": [{"text": "hello"}], "params": {"remote_block_ids": [1, 2]}})
    assert [b["max_tokens"] for b in fakes.seen["prefill"]] == [1, 1]
    assert all(b["stream"] is False for b in fakes.seen["prefill"])
    # The decode instance gets the client's request plus the prefill side's params.
    assert fakes.seen["decode"][0] == {
        "prompt": "hi",
        "max_tokens": 5,
        "kv_transfer_params": {"remote_block_ids": [1, 2]},
    }
    assert fakes.seen["decode"][1]["stream"] is True
    status, text = streamed
    assert status == 200 and text.count("data: ") == 3 and text.endswith("data: [DONE]\n\n")
    assert health["decode"]["in_flight"] == dict.fromkeys(health["decode"]["in_flight"], 0)
    assert list(health["prefill"]["served"].values()) == [2]


def test_unreachable_prefill_sends_the_request_to_decode_alone() -> None:
    fakes, (plain, streamed, _) = asyncio.run(_scenario(prefill_up=False))
    assert plain == (200, {"choices": [{"text": "hello"}], "params": None})
    assert "kv_transfer_params" not in fakes.seen["decode"][0]
    assert streamed[0] == 200
