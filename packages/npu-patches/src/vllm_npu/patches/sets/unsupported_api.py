# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``unsupported-api-status``: a request to an endpoint the served model does not support answers HTTP 400.

Each route of vLLM 0.11.0's API server (``vllm/entrypoints/openai/api_server.py``: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``, ``/score``, ``/rerank``, ``/pooling``, ``/classify``, ...) answers a
model without that task with ``return base(raw_request).create_error_response(message="The model does not support
... API")``: the ``ErrorResponse`` model itself, which FastAPI serialises with the route's default status, 200. So a
completion request to an embedding model, or an embedding request to a chat model, "succeeds" with an error body
whose own ``code`` says 400, and OpenAI clients parse it as a (broken) success (vllm#16831 shows the symptom).

The replacement ``base`` hands the routes the same serving object, except that its ``create_error_response``
returns a ``JSONResponse`` with the error's own status code (400) and the same body. The response also keeps the
``ErrorResponse`` attributes the one other caller reads (``/invocations``: ``res.model_dump()``,
``res.error.code``), so that route answers as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse  # the module is imported only when the patch is applied


class ErrorJSONResponse(JSONResponse):
    """An ``ErrorResponse`` as an HTTP response with its own status code, still readable as the ``ErrorResponse``
    (``model_dump()``, ``error``)."""

    def __init__(self, error: Any) -> None:
        super().__init__(content=error.model_dump(), status_code=error.error.code)
        self.error = error.error
        self.model_dump = error.model_dump


class StatusErrors:
    """The serving object vLLM's ``base`` returns, with ``create_error_response`` answering with its status."""

    def __init__(self, serving: Any) -> None:
        self._serving = serving

    def create_error_response(self, *args: Any, **kwargs: Any) -> ErrorJSONResponse:
        return ErrorJSONResponse(self._serving.create_error_response(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._serving, name)


def make_replacement(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Build the ``base(request)`` whose ``create_error_response`` carries the HTTP status (``original`` is kept
    by the registry)."""

    def base(request: Any) -> Any:
        """vLLM's ``base(request)`` (the tokenization serving object), whose error responses carry their status."""
        return StatusErrors(original(request))

    base.__module__ = original.__module__
    base.__wrapped__ = original  # type: ignore[attr-defined]
    return base
