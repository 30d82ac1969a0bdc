# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``eagle-discarded-next-token``: a request still in chunked prefill never hands token id -1 to the drafter.

vLLM 0.11.0's ``EagleProposer.prepare_next_token_ids_padded`` (the default, padded drafter path of EAGLE, EAGLE-3
and DeepSeek MTP) blanks the sampled token of every *discarded* request (one whose prompt is not fully prefilled
yet: its sampled token is meaningless) with -1, then counts the valid tokens per row. When no request of the step
carries draft tokens (``sampled_token_ids`` has one column: e.g. the first step of a batch, all prefill) it skips
the validity test and counts every column as valid, so a discarded row keeps -1 as its "next token" instead of the
backup token (the prompt token after the chunk). The drafter then embeds token -1: ``IndexError: index out of range
in self`` on the emulated device, an out-of-range gather on an NPU. Whether a step hits it depends on request
arrival (a step with a partial prefill and no decode with drafts), so it fails intermittently.

The replacement runs vLLM's function, then gives every discarded row its backup token and a valid count of 0, which
is what the function returns for such rows when the step has drafts, and what vLLM computes after the upstream fix
(vllm#26231 / vllm#26263 test the mask for every step). Device ops only (no host sync), as the original.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def make_replacement(original: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    """Build ``prepare_next_token_ids_padded`` with discarded rows fixed (``original`` is kept by the registry)."""

    def prepare_next_token_ids_padded(
        self: Any,
        common_attn_metadata: Any,
        sampled_token_ids: torch.Tensor,
        requests: dict[str, Any],
        gpu_input_batch: Any,
        discard_request_indices: torch.Tensor,
        num_discarded_requests: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(next_token_ids [num_reqs] int, valid_sampled_tokens_count [num_reqs])`` as vLLM's, except that a
        discarded request's next token is its backup token (``requests[id].get_token_id(seq_len)``, which the
        original has just written to ``self.backup_next_token_ids``) and its count is 0."""
        next_token_ids, valid_count = original(
            self,
            common_attn_metadata,
            sampled_token_ids,
            requests,
            gpu_input_batch,
            discard_request_indices,
            num_discarded_requests,
        )
        if num_discarded_requests:
            rows = discard_request_indices[:num_discarded_requests]
            backup = self.backup_next_token_ids.gpu.index_select(0, rows).to(next_token_ids.dtype)
            next_token_ids.index_copy_(0, rows, backup)
            valid_count.index_fill_(0, rows, 0)
        return next_token_ids, valid_count

    prepare_next_token_ids_padded.__module__ = original.__module__
    prepare_next_token_ids_padded.__qualname__ = original.__qualname__
    prepare_next_token_ids_padded.__wrapped__ = original  # type: ignore[attr-defined]
    return prepare_next_token_ids_padded
