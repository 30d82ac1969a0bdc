# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""hybrid-prefill-no-drafts: drafts proposed for a request still in its prompt are dropped (its last prompt chunk
must not carry them: a gated delta-net layer would fold them into its state), drafts of requests past their prompt
are vLLM's. The engine-level proof is tests/e2e/test_qwen3_next_mtp_engine.py (chunked 150-token prompt with MTP)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds
from vllm_npu.patches.sets.hybrid_prefill_drafts import make_replacement

pytestmark = pytest.mark.usefixtures("vllm_unpatched")


class _Request(SimpleNamespace):
    def is_finished(self) -> bool:
        return False


def _scheduler() -> SimpleNamespace:
    requests = {
        "prefilling": _Request(num_computed_tokens=64, num_prompt_tokens=150, spec_token_ids=[]),
        "prompt-done": _Request(num_computed_tokens=150, num_prompt_tokens=150, spec_token_ids=[]),
        "decoding": _Request(num_computed_tokens=160, num_prompt_tokens=150, spec_token_ids=[]),
    }
    return SimpleNamespace(requests=requests, structured_output_manager=SimpleNamespace(should_advance=lambda r: False))


def test_drafts_of_a_partly_prefilled_request_are_dropped_others_kept() -> None:
    scheduler = _scheduler()
    drafts = DraftTokenIds(["prefilling", "prompt-done", "decoding"], [[7, 8], [9, 10], [11, 12]])
    make_replacement(Scheduler.update_draft_token_ids)(scheduler, drafts)
    assert scheduler.requests["prefilling"].spec_token_ids == []
    assert scheduler.requests["prompt-done"].spec_token_ids == [9, 10]
    assert scheduler.requests["decoding"].spec_token_ids == [11, 12]


def test_vllm_alone_keeps_the_partial_requests_drafts() -> None:
    """The behaviour the patch changes: vLLM 0.11.0 stores the drafts of a request still in its prompt."""
    scheduler = _scheduler()
    Scheduler.update_draft_token_ids(scheduler, DraftTokenIds(["prefilling"], [[7, 8]]))  # type: ignore[arg-type]
    assert scheduler.requests["prefilling"].spec_token_ids == [7, 8]
