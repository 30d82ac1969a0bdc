# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu pd-proxy --prefill URL... --decode URL... [--host H] [--port P] [--policy round_robin|least_loaded]``.

Serves :mod:`vllm_npu.kv.proxy` with uvicorn until interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

from .proxy import POLICIES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-npu pd-proxy",
        description="OpenAI-compatible proxy for prefill-decode disaggregated vLLM instances (npu-kv's "
        "MooncakeConnector): prefill on one instance, decode on another.",
    )
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (http://host:port)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (http://host:port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--policy", choices=POLICIES, default="round_robin", help="how instances are picked per role")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one upstream request may take")
    return p


def url_problem(url: str) -> str | None:
    """Why ``url`` is not an instance base URL ``http(s)://host:port`` (None when it is one)."""
    example = "e.g. http://127.0.0.1:8100"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s) URL ({example})"
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number in 0-65535)
    except ValueError:
        return f"{url!r} has an invalid port ({example})"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"{url!r} must be an instance's base URL without a path (the proxy adds /v1/...; {example})"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    problems = [p for p in map(url_problem, (*args.prefill, *args.decode)) if p]
    if not 0 < args.port < 65536:
        problems.append(f"--port {args.port} is not a TCP port (1-65535)")
    if not args.timeout > 0:
        problems.append(f"--timeout {args.timeout} must be a positive number of seconds")
    if problems:
        print(f"vllm-npu pd-proxy: {problems[0]}", file=sys.stderr)
        return 2
    import uvicorn

    from .proxy import create_app

    strip = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    app = create_app(*strip, args.policy, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
