# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""eagle-discarded-next-token: vLLM 0.11.0's padded drafter inputs give a request in chunked prefill the next token
-1 when the step has no draft tokens (the bug, shown on vLLM's own function), and its backup token with the patch;
with draft tokens in the step the patched function returns exactly what vLLM's does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.utils import CpuGpuBuffer
from vllm_npu.patches.sets.eagle_next_token import make_replacement

pytestmark = pytest.mark.usefixtures("vllm_unpatched")

VOCAB = 100
ORIGINAL = EagleProposer.prepare_next_token_ids_padded
PATCHED = make_replacement(ORIGINAL)
#: three requests; their tokens so far (prompt, then outputs); request "b" is mid-prefill
TOKENS = {"a": [5, 6, 7, 8], "b": [11, 12, 13, 14, 15, 16], "c": [21, 22, 23]}
SEQ_LENS = [4, 3, 3]  # computed + scheduled tokens after this step: "b" has 3 of its 6 prompt tokens


def _call(fn, sampled: torch.Tensor, discarded: list[int]):
    proposer = SimpleNamespace(
        backup_next_token_ids=CpuGpuBuffer(8, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False)
    )
    requests = {
        rid: SimpleNamespace(get_token_id=lambda i, t=toks: t[i] if i < len(t) else -1) for rid, toks in TOKENS.items()
    }
    batch = SimpleNamespace(num_reqs=3, req_ids=list(TOKENS), vocab_size=VOCAB)
    metadata = SimpleNamespace(seq_lens_cpu=torch.tensor(SEQ_LENS))
    indices = torch.zeros(8, dtype=torch.int64)
    indices[: len(discarded)] = torch.tensor(discarded, dtype=torch.int64)
    next_ids, counts = fn(proposer, metadata, sampled.clone(), requests, batch, indices, len(discarded))
    return next_ids.tolist(), counts.tolist()


def test_a_step_without_drafts_gives_the_partial_prefill_its_backup_token():
    sampled = torch.tensor([[40], [41], [42]])  # one column: no request of this step has draft tokens
    assert _call(ORIGINAL, sampled, [1]) == ([40, -1, 42], [1, 1, 1])  # vLLM 0.11.0: token -1 for "b"
    # "b": the prompt token after its 3 prefilled ones (TOKENS["b"][3]); no valid sampled token
    assert _call(PATCHED, sampled, [1]) == ([40, 14, 42], [1, 0, 1])


def test_a_step_with_drafts_is_unchanged():
    # three columns (2 drafts + bonus), rejected positions are -1; "b" discarded
    sampled = torch.tensor([[40, 50, -1], [41, 51, 61], [42, -1, -1]])
    expected = _call(ORIGINAL, sampled, [1])
    assert expected == ([50, 14, 42], [2, 0, 1])
    assert _call(PATCHED, sampled, [1]) == expected


def test_no_discarded_request_is_unchanged():
    sampled = torch.tensor([[40], [41], [42]])
    assert _call(PATCHED, sampled, []) == _call(ORIGINAL, sampled, []) == ([40, 41, 42], [1, 1, 1])
