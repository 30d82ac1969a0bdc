# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Structured output's grammar bitmask for every logits dtype (against vLLM's own float32 path), and one request's
failing logits processing recorded for that request only (bitmask rows, per-request logits processors)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm_npu.platform.sample import apply_grammar_bitmask, isolated_request_logitsprocs

VOCAB = 100
WORDS = (VOCAB + 31) // 32


def _step(structured: dict[str, int], spec: dict[str, list[int]], seed: int = 0) -> tuple[Any, np.ndarray]:
    rows = sum(1 + len(spec.get(r, [])) for r in structured)
    bitmask = np.random.default_rng(seed).integers(-(2**31), 2**31 - 1, size=(rows, WORDS), dtype=np.int32)
    out = SimpleNamespace(structured_output_request_ids=structured, scheduled_spec_decode_tokens=spec)
    return out, bitmask


def _vllm_reference(step: Any, bitmask: np.ndarray, batch: dict[str, int], logits: torch.Tensor) -> torch.Tensor:
    """vLLM 0.11's own apply_grammar_bitmask on a float32 copy (its CPU path works for float32 only)."""
    from vllm.v1.structured_output.utils import apply_grammar_bitmask as vllm_apply

    ref = logits.float().clone()
    step = SimpleNamespace(**vars(step), grammar_bitmask=bitmask)
    vllm_apply(step, SimpleNamespace(req_id_to_index=batch), ref, torch.device("cpu"))
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bitmask_matches_vllm_float32_for_every_dtype(dtype):
    # 4 requests in batch order a, b, c, d; b and d are structured, c has 2 draft tokens (3 logit rows).
    batch = {"a": 0, "b": 1, "c": 2, "d": 3}
    spec = {"c": [5, 6], "b": [7]}
    step, bitmask = _step({"d": 0, "b": 1}, spec)
    logits = torch.randn(1 + 2 + 3 + 1, VOCAB).to(dtype)
    expected = _vllm_reference(step, bitmask, batch, logits)
    before = logits.clone()
    assert apply_grammar_bitmask(step, bitmask, batch, logits) == {}
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert torch.equal(logits[finite], before[finite])  # allowed tokens keep their exact value
    assert torch.isinf(logits).any() and not torch.isinf(logits[0]).any()  # a is not structured


def test_request_the_runner_no_longer_holds_is_skipped():
    step, bitmask = _step({"gone": 0, "b": 1}, {})
    logits = torch.randn(2, VOCAB, dtype=torch.bfloat16)
    expected = _vllm_reference(step, bitmask, {"a": 0, "b": 1}, logits)
    assert apply_grammar_bitmask(step, bitmask, {"a": 0, "b": 1}, logits) == {}
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))


def test_one_failing_request_is_reported_and_the_others_masked(monkeypatch):
    import xgrammar as xgr

    batch = {"a": 0, "b": 1, "c": 2}
    step, bitmask = _step({"a": 0, "b": 1, "c": 2}, {})
    bitmask[1] = 7  # request b's row: the fake kernel below fails on it
    original = xgr.apply_token_bitmask_inplace

    def flaky(logits: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> None:
        if bool((mask == 7).all(dim=-1).any()):
            raise RuntimeError("matcher state broken")
        original(logits, mask, **kwargs)

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", flaky)
    logits = torch.randn(3, VOCAB, dtype=torch.bfloat16)
    before = logits.clone()
    faults = apply_grammar_bitmask(step, bitmask, batch, logits)
    assert faults == {"b": "structured output failed: RuntimeError: matcher state broken"}
    assert torch.equal(logits[1], before[1])  # left as it was: the request is failed, not sampled from
    assert torch.isinf(logits[0]).any() and torch.isinf(logits[2]).any()


def _batch_with_request_processors(procs: dict[int, Any]) -> Any:
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class Adapter(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params: Any) -> Any:
            return None

    adapter = Adapter.__new__(Adapter)
    adapter.req_info = dict(procs)
    logitsprocs = SimpleNamespace(all=[adapter])
    return SimpleNamespace(logitsprocs=logitsprocs, req_ids=["r0", "r1", "r2"]), adapter


def test_failing_request_logits_processor_is_recorded_and_the_others_run():
    def boom(row: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad extra_args")

    def ban_token_0(row: torch.Tensor) -> torch.Tensor:
        row[0] = float("-inf")
        return row

    batch, adapter = _batch_with_request_processors({0: ban_token_0, 1: boom, 2: ban_token_0})
    original_state = adapter.req_info
    logits = torch.zeros(3, VOCAB)
    faults: dict[str, str] = {}
    with isolated_request_logitsprocs(batch, faults):
        adapter.apply(logits)
    assert faults == {"r1": "logits processor failed: ValueError: bad extra_args"}
    assert torch.isinf(logits[0, 0]) and torch.isinf(logits[2, 0]) and not torch.isinf(logits[1]).any()
    assert adapter.req_info is original_state  # the processor's own state is back


def test_without_the_guard_the_failure_propagates():
    def boom(row: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad extra_args")

    _, adapter = _batch_with_request_processors({0: boom})
    with pytest.raises(ValueError, match="bad extra_args"):
        adapter.apply(torch.zeros(1, VOCAB))
