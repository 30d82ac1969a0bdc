# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``hybrid-prefill-no-drafts``: a request still in its prompt gets no draft tokens.

vLLM 0.11's EAGLE/MTP proposer drafts for every request of a step, also for a request whose prompt is only partly
prefilled (its draft is built on a discarded token), and ``Scheduler.update_draft_token_ids`` keeps those drafts. The
request's last prompt chunk is then scheduled as ``prompt tail + drafts``; the runner classes it as a prefill (its
computed tokens are short of the prompt), so a recurrent-state layer (Qwen3-Next's gated delta-net, Mamba) runs the
draft tokens as if they were prompt and stores a state that includes them. When the sampler rejects a draft the
state is wrong from the first decode step on (vllm#30618: Qwen3-Next with MTP and chunked prefill gives wrong tokens).
Attention models only waste the verification of those drafts.

The replacement runs vLLM's method, then clears the drafts of every request whose computed tokens are short of its
prompt: such a request's next chunk carries prompt tokens only, and its first verification step comes after its
prompt is complete (the drafts proposed in the step that completes it are kept).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_replacement(original: Callable[..., None]) -> Callable[..., None]:
    """Build ``Scheduler.update_draft_token_ids`` that drops drafts of partly prefilled requests."""

    def update_draft_token_ids(self: Any, draft_token_ids: Any) -> None:
        """vLLM's method, then ``spec_token_ids`` cleared for each listed request with
        ``num_computed_tokens < num_prompt_tokens`` (still prefilling)."""
        original(self, draft_token_ids)
        for req_id in draft_token_ids.req_ids:
            request = self.requests.get(req_id)
            if request is not None and request.num_computed_tokens < request.num_prompt_tokens:
                request.spec_token_ids.clear()

    update_draft_token_ids.__module__ = original.__module__
    update_draft_token_ids.__qualname__ = original.__qualname__
    update_draft_token_ids.__wrapped__ = original  # type: ignore[attr-defined]
    return update_draft_token_ids
