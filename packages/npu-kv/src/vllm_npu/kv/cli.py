# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu pd-proxy --prefill URL... --decode URL... [--host H] [--port P] [--policy round_robin|least_loaded]``.

Serves :mod:`vllm_npu.kv.proxy` with uvicorn until interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    for url in (*args.prefill, *args.decode):
        if not url.startswith(("http://", "https://")):
            print(f"vllm-npu pd-proxy: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8100)", file=sys.stderr)
            return 2
    import uvicorn

    from .proxy import create_app

    app = create_app(args.prefill, args.decode, args.policy, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
