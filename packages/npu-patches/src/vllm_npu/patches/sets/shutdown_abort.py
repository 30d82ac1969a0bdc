# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``shutdown-ends-requests``: when an ``AsyncLLM`` shuts down, every request still in flight ends with
``finish_reason`` ``"abort"`` instead of waiting forever.

In vLLM 0.11.0, SIGTERM or SIGINT to ``vllm serve`` cancels the uvicorn task in ``serve_http``
(``vllm/entrypoints/launcher.py``); ``run_server_worker`` (``vllm/entrypoints/openai/api_server.py``) then leaves the
``build_async_engine_client`` block, whose ``finally`` calls ``AsyncLLM.shutdown()`` (the engine-core process is
stopped and the output handler cancelled), and only then awaits uvicorn's shutdown, which waits for open connections
to close. A streaming response in flight is awaiting its request's output queue, which nothing fills any more: the
client sees neither an error nor a finish, and the server never exits (uvicorn waits for that connection).

The replacement first hands every in-flight request its final output through vLLM's own
``OutputProcessor.abort_requests`` (a finished output with ``FinishReason.ABORT``, what a client disconnect gets) and
then runs vLLM's ``shutdown``. The streaming generators then send their last chunk (``finish_reason: "abort"``)
and ``data: [DONE]``; non-streaming requests return what they generated so far with ``finish_reason: "abort"``;
uvicorn's shutdown finds the connections closing and the server exits. The engine core is not told to abort: it is
being stopped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_npu.interface import get_logger

logger = get_logger(__name__)


def end_in_flight_requests(async_llm: Any) -> list[str]:
    """Give every request the ``AsyncLLM`` still tracks its final output (finish reason ``abort``); their ids."""
    processor = getattr(async_llm, "output_processor", None)
    if processor is None:  # shut down before it was built (a failed start)
        return []
    ids = list(processor.request_states)
    if ids:
        processor.abort_requests(ids)
        logger.warning(
            "engine shutting down: %d request(s) in flight ended with finish_reason 'abort' (%s)",
            len(ids),
            ", ".join(ids[:8]) + (", ..." if len(ids) > 8 else ""),
        )
    return ids


def make_replacement(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``AsyncLLM.shutdown`` that ends the in-flight requests first (``original`` is kept by the registry)."""

    @functools.wraps(original)
    def shutdown(self: Any) -> None:
        end_in_flight_requests(self)
        original(self)

    return shutdown
