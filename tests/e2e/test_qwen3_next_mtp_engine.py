# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen3-Next with its MTP draft (``--speculative-config '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'``)
in a real vLLM engine on the emulated device: npu-models' ``NPUQwen3NextMTP`` drafts, the target's GDN layers verify
``1 + k`` tokens per request from the state slots of the previous step's accepted tokens (conv state ``W - 1 + k``
columns, ``1 + k`` recurrent-state slots per request), vLLM's hybrid KV-cache manager, TP=1, float32, eager. Graphs:
FULL_DECODE_ONLY with spec decode is downgraded by vLLM to eager (our attention builders capture single-token decode
only; the runner then stops the GDN builder padding, ``NPUModelRunner._builders_follow_resolved_mode``); PIECEWISE
starts (the draft included) but its compile costs ~2.5 min on the loaded 2-core host, past the module budget.

HF has no MTP module, so losslessness is the target's greedy tokens: the engine's greedy output equals HF
transformers' greedy ``Qwen3NextForCausalLM`` (eager attention), with drafts accepted (the tiny draft is built to
propose "the last token again", which the tiny model's greedy text often is: ``build_tiny_qwen3_next_mtp``) and
rejected. A 64-token step budget chunks the 150-token prompt while others decode (this needs
npu-patches' ``hybrid-prefill-no-drafts``: without it the last prompt chunk carries drafts into the GDN state); 48 KV blocks preempt a wave of long
prompts. The engine core runs in its own process: vLLM 0.11 hands drafts to the scheduler only in the busy loop's
``post_step``.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts
from npu_testkit.graph_e2e import MIXED_LENGTHS
from npu_testkit.models import hf_greedy
from npu_testkit.models_hybrid import build_tiny_qwen3_next_mtp, tiny_qwen3_next_config

pytestmark = pytest.mark.engine

K = 2
NEW_TOKENS = 24
BLOCKS = 48


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_qwen3_next_mtp(tiny_qwen3_next_config())


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    kwargs = {
        "enforce_eager": True,
        "speculative_config": {"method": "qwen3_next_mtp", "num_speculative_tokens": K},
        "block_size": 16,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        "num_gpu_blocks_override": BLOCKS,
        "disable_log_stats": False,
    }
    env = emulated_env(tmp_path_factory.mktemp("qwen3next-mtp"), multiprocessing=True)
    with engine(model_dir, env, **kwargs) as llm:
        yield llm


def _counter(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _spec_counters(llm) -> tuple[float, float]:
    return _counter(llm, "vllm:spec_decode_num_draft_tokens"), _counter(llm, "vllm:spec_decode_num_accepted_tokens")


def test_the_draft_is_ours_on_the_hybrid_stack(llm):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["drafter"] == "vllm.v1.spec_decode.eagle.EagleProposer"
    assert info["draft_model"] == "vllm_npu.models.qwen3_next_mtp.NPUQwen3NextMTP"
    assert info["reorder_batch_threshold"] == 1 + K
    assert info["plugin_modules"]["NPUQwen3NextGatedDeltaNet"] == 3


def test_greedy_with_mtp_equals_hf_chunked_and_mixed_with_accepted_drafts(llm, model_dir):
    prompts = make_prompts(MIXED_LENGTHS, seed=12)
    drafted_before, accepted_before = _spec_counters(llm)
    got = greedy(llm, prompts, NEW_TOKENS)
    drafted, accepted = (
        after - before for after, before in zip(_spec_counters(llm), (drafted_before, accepted_before))
    )
    assert got == hf_greedy(model_dir, prompts, NEW_TOKENS, attn_implementation="eager")
    print(f"MTP k={K}: {accepted:.0f} of {drafted:.0f} drafted tokens accepted")
    # Verification really ran both ways: drafts accepted (several tokens per step) and rejected.
    assert 0 < accepted < drafted, (drafted, accepted)


def test_preempted_requests_resume_with_mtp(llm, model_dir):
    """Six 100-token prompts need more blocks than the 47 usable (attention pages plus ``1 + k`` state slots per GDN
    group each): the scheduler preempts and later recomputes from a fresh state, and the drafts stay lossless."""
    prompts = make_prompts([100] * 6, seed=5)
    before = _counter(llm, "vllm:num_preemptions")
    assert greedy(llm, prompts, NEW_TOKENS) == hf_greedy(model_dir, prompts, NEW_TOKENS, attn_implementation="eager")
    assert _counter(llm, "vllm:num_preemptions") > before, "no request was preempted"
