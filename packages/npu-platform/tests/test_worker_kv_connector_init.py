# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUWorker.initialize_from_config makes the worker's KV connector where the installed vLLM expects it: vLLM 0.11.1
moved ``ensure_kv_transfer_initialized`` (now taking the KV cache config) from the distributed-environment start into
``Worker.initialize_from_config``; without the call a decode instance never pulls its KV (tests/e2e/test_pd_*)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import vllm.distributed.kv_transfer as kv_transfer
from vllm_npu.platform import worker as worker_mod


def _worker(calls: list[tuple[str, Any]]) -> Any:
    w = object.__new__(worker_mod.NPUWorker)
    w.vllm_config = SimpleNamespace(name="the vllm config")
    w.model_runner = SimpleNamespace(initialize_kv_cache=lambda cfg: calls.append(("initialize_kv_cache", cfg)))
    return w


@pytest.mark.parametrize("at_kv_cache_init", [True, False])
def test_the_connector_is_made_before_the_kv_cache_when_vllm_moved_it(
    monkeypatch: pytest.MonkeyPatch, at_kv_cache_init: bool
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(worker_mod, "KV_CONNECTOR_AT_KV_CACHE_INIT", at_kv_cache_init)
    monkeypatch.setattr(
        kv_transfer, "ensure_kv_transfer_initialized", lambda vc, cfg=None: calls.append(("connector", (vc, cfg)))
    )
    w = _worker(calls)
    w.initialize_from_config("the kv cache config")
    made = [("connector", (w.vllm_config, "the kv cache config"))] if at_kv_cache_init else []
    assert calls == [*made, ("initialize_kv_cache", "the kv cache config")]


def test_the_choice_is_read_off_the_installed_vllm() -> None:
    params = inspect.signature(kv_transfer.ensure_kv_transfer_initialized).parameters
    assert worker_mod.KV_CONNECTOR_AT_KV_CACHE_INIT is ("kv_cache_config" in params)
