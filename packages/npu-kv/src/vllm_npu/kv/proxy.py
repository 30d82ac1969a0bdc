# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The PD proxy: one OpenAI-compatible endpoint in front of prefill and decode instances.

Per request (``/v1/completions`` or ``/v1/chat/completions``): pick a prefill instance, send it the request with
``max_tokens=1``, no streaming and ``kv_transfer_params={"do_remote_decode": true}``; take the ``kv_transfer_params``
of its answer (where its blocks are held) into the original request and send that to a decode instance, whose answer
(streamed or not) is the client's. The decode instance pulls the prompt's KV and computes only what follows it.

A prefill instance that cannot be reached or answers with an error does not fail the request: it goes to the decode
instance without remote prefill, which computes the prompt itself (logged as a warning). A decode instance's error
is the client's error, with its status and body.

Instances are picked per pool by ``round_robin`` or ``least_loaded`` (fewest requests in flight through this proxy).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("vllm_npu.kv.proxy")

POLICIES = ("round_robin", "least_loaded")


@dataclass
class Pool:
    """Instances of one role and the proxy's view of their load."""

    urls: list[str]
    policy: str = "round_robin"
    in_flight: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("a pool needs at least one instance URL")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        self.urls = [u.rstrip("/") for u in self.urls]
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.served = dict.fromkeys(self.urls, 0)
        self._cycle = itertools.cycle(self.urls)

    def pick(self) -> str:
        if self.policy == "round_robin":
            url = next(self._cycle)
        else:  # ties go to the instance that has served fewer requests, then to the first listed
            url = min(self.urls, key=lambda u: (self.in_flight[u], self.served[u]))
        self.in_flight[url] += 1
        self.served[url] += 1
        return url

    def release(self, url: str) -> None:
        self.in_flight[url] -= 1


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill instance gets: one token, not streamed, and asked to hold its KV."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


@dataclass
class ProxyState:
    """What the proxy's handlers share: the two pools and one HTTP session (opened on first use, closed at shutdown)."""

    pools: dict[str, Pool]
    timeout_s: float
    _session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        # Created lazily: an aiohttp session must be made inside the running event loop, which create_app is not.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def _state(request: Request) -> ProxyState:
    state: ProxyState = request.app.state.proxy
    return state


async def run_prefill(
    state: ProxyState, path: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any] | None:
    """Send ``body`` to a prefill instance (see :func:`prefill_body`); its ``kv_transfer_params``, or None when the
    instance cannot be reached, answers with an error or returns none (the decode instance then computes the prompt)."""
    pool = state.pools["prefill"]
    url = pool.pick()
    try:
        async with state.session().post(f"{url}{path}", json=prefill_body(body), headers=headers) as resp:
            if resp.status != 200:
                text = await resp.text()
                logger.warning(
                    "prefill %s answered %d (%s); the decode instance computes the prompt",
                    url,
                    resp.status,
                    text[:300],
                )
                return None
            answer = await resp.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        logger.warning(
            "prefill %s unreachable (%s: %s); the decode instance computes the prompt", url, type(exc).__name__, exc
        )
        return None
    finally:
        pool.release(url)
    params = answer.get("kv_transfer_params")
    if not params:
        logger.warning("prefill %s returned no kv_transfer_params; the decode instance computes the prompt", url)
    return params if isinstance(params, dict) else None


async def forward(state: ProxyState, path: str, request: Request) -> Response:
    """One client request: prefill (best effort), then decode, whose answer (streamed or not) is the client's."""
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return JSONResponse({"error": {"message": "the request body is not JSON"}}, status_code=400)
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    params = await run_prefill(state, path, body, headers)
    decode_body = copy.deepcopy(body)
    if params is not None:
        decode_body["kv_transfer_params"] = params
    else:
        decode_body.pop("kv_transfer_params", None)
    pool = state.pools["decode"]
    url = pool.pick()
    try:
        resp = await state.session().post(f"{url}{path}", json=decode_body, headers=headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        pool.release(url)
        return JSONResponse(
            {"error": {"message": f"decode instance {url} unreachable: {type(exc).__name__}: {exc}"}},
            status_code=502,
        )
    if not body.get("stream"):
        try:
            content = await resp.read()
            return Response(content, status_code=resp.status, media_type=resp.content_type)
        finally:
            resp.release()
            pool.release(url)

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.content.iter_any():
                yield chunk
        finally:
            resp.release()
            pool.release(url)

    return StreamingResponse(stream(), status_code=resp.status, media_type=resp.content_type)


# --- routes (module-level; each reads the app's ProxyState) ---


async def completions(request: Request) -> Response:
    return await forward(_state(request), "/v1/completions", request)


async def chat(request: Request) -> Response:
    return await forward(_state(request), "/v1/chat/completions", request)


async def models(request: Request) -> Response:
    state = _state(request)
    url = state.pools["decode"].urls[0]
    async with state.session().get(f"{url}/v1/models") as resp:
        return Response(await resp.read(), status_code=resp.status, media_type=resp.content_type)


async def health(request: Request) -> dict[str, Any]:
    return {
        role: {"policy": pool.policy, "in_flight": pool.in_flight, "served": pool.served}
        for role, pool in _state(request).pools.items()
    }


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await app.state.proxy.close()


def create_app(
    prefill: Sequence[str], decode: Sequence[str], policy: str = "round_robin", timeout_s: float = 600.0
) -> FastAPI:
    """The proxy's ASGI app over the given instance base URLs (``http://host:port``)."""
    pools = {"prefill": Pool(list(prefill), policy), "decode": Pool(list(decode), policy)}
    app = FastAPI(title="vllm-npu pd-proxy", lifespan=_lifespan)
    app.state.proxy = ProxyState(pools, timeout_s)
    app.state.pools = pools
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    return app
