# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPURejectionSampler against a slow per-request Python reference of vLLM 0.11's rejection-sampling kernels.

The reference walks each request position by position, exactly as vLLM's Triton kernels do, and draws its random
numbers from a fresh generator with the request's seed in vLLM's order (uniforms for the draft positions, then one
Exp(1) vector over the vocabulary), so seeded requests must give identical tokens. The sampler inside a real engine
(ngram speculative decoding on the normal NPUWorker) is tested in ``tests/e2e/test_attention_spec_decode.py``.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm_npu.platform.sample import NPURejectionSampler
from vllm_npu.platform.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

VOCAB = 32


def sampling_metadata(
    temperatures: list[float],
    seeds: list[int | None] | None = None,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
) -> SamplingMetadata:
    """Metadata as vLLM 0.11's InputBatch builds it: temperature 0.0 marks a greedy request."""
    greedy = [t == 0.0 for t in temperatures]
    all_greedy, all_random = all(greedy), not any(greedy)
    gens = {}
    for i, s in enumerate(seeds or []):
        if s is not None:
            gens[i] = torch.Generator().manual_seed(s)
    return SamplingMetadata(
        temperature=None if all_greedy else torch.tensor(temperatures, dtype=torch.float32),
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        generators=gens,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(len(temperatures)),
        presence_penalties=torch.zeros(len(temperatures)),
        repetition_penalties=torch.ones(len(temperatures)),
        output_token_ids=[[] for _ in temperatures],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def reference(
    drafts: list[list[int]],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus: list[int],
    temperatures: list[float],
    seeds: list[int | None],
    top_k: list[int] | None = None,
) -> list[list[int]]:
    """One request and one position at a time, as in the paper / vLLM's kernels. Rows are padded to
    ``max_spec_len + 1`` with the placeholder."""
    width = max(len(d) for d in drafts) + 1
    out, start = [], 0
    for i, d in enumerate(drafts):
        n = len(d)
        logits = target_logits[start : start + n].clone()
        row: list[int] = []
        if temperatures[i] == 0.0:
            for j in range(n):
                t = int(logits[j].argmax())
                row.append(t)
                if t != d[j]:
                    break
            else:
                row.append(bonus[i])
        else:
            logits = logits / temperatures[i]
            if top_k is not None and top_k[i] < logits.shape[1]:
                kth = logits.topk(top_k[i], dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            p = logits.softmax(dim=-1, dtype=torch.float32)
            g = torch.Generator().manual_seed(seeds[i])
            u = torch.empty(n, dtype=torch.float64).uniform_(generator=g) if n else None
            q = torch.empty(target_logits.shape[1]).exponential_(generator=g) if n else None
            for j in range(n):
                dp = 1.0 if draft_probs is None else float(draft_probs[start + j, d[j]])
                tp = float(p[j, d[j]])
                if dp > 0 and tp / dp >= float(u[j]):
                    row.append(d[j])
                    continue
                if draft_probs is None:
                    resid = p[j].clone()
                    resid[d[j]] = 0
                else:
                    resid = (p[j] - draft_probs[start + j]).clamp_min(0)
                row.append(int((resid / q).argmax()))
                break
            else:
                row.append(bonus[i])
        out.append(row + [PLACEHOLDER_TOKEN_ID] * (width - len(row)))
        start += n
    return out


def run(drafts, draft_probs, target_logits, bonus, temperatures, seeds=None, top_k=None, bonus_2d=True):
    md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    b = torch.tensor(bonus, dtype=torch.int32)
    out = NPURejectionSampler()(
        md,
        draft_probs,
        target_logits.clone(),  # may be updated in place
        b.unsqueeze(1) if bonus_2d else b,
        sampling_metadata(temperatures, seeds, top_k),
    )
    assert out.dtype == torch.int32 and out.shape == (len(drafts), md.max_spec_len + 1)
    return out.tolist()


def random_case(lengths: list[int], seed: int, *, agree: float = 0.6, with_draft_probs: bool = False):
    """Drafts that agree with the target argmax with probability ``agree`` (so accept prefixes vary), sharp
    target logits (scale 3) so random acceptance is neither always nor never."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    argmax = logits.argmax(-1)
    other = torch.randint(0, VOCAB, (n,), generator=g)
    pick = torch.rand(n, generator=g) < agree
    flat = torch.where(pick, argmax, other).tolist()
    drafts, s = [], 0
    for k in lengths:
        drafts.append(flat[s : s + k])
        s += k
    draft_probs = None
    if with_draft_probs:
        draft_probs = (torch.randn(n, VOCAB, generator=g) * 2).softmax(-1)
        draft_probs[0, :] = 0  # a zero draft probability must reject, never divide
        draft_probs[0, 1] = 1
    bonus = torch.randint(0, VOCAB, (len(lengths),), generator=g).tolist()
    return drafts, draft_probs, logits, bonus


LENGTHS = [3, 0, 1, 4, 2, 4, 0, 3]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_batch_matches_reference(seed):
    drafts, _, logits, bonus = random_case(LENGTHS, seed)
    temps = [0.0] * len(LENGTHS)
    assert run(drafts, None, logits, bonus, temps) == reference(drafts, None, logits, bonus, temps, [None] * 8)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["ngram", "draft_probs"])
@pytest.mark.parametrize("seed", range(4))
def test_random_batch_matches_reference(seed, with_draft_probs):
    drafts, dp, logits, bonus = random_case(LENGTHS, seed, with_draft_probs=with_draft_probs)
    temps = [0.7, 1.0, 1.3, 0.9, 1.0, 2.0, 0.5, 1.1]
    seeds = [100 * seed + i for i in range(len(LENGTHS))]
    got = run(drafts, dp, logits, bonus, temps, seeds)
    assert got == reference(drafts, dp, logits, bonus, temps, seeds)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["ngram", "draft_probs"])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_batch_with_top_k_matches_reference(seed, with_draft_probs):
    drafts, dp, logits, bonus = random_case(LENGTHS, seed, with_draft_probs=with_draft_probs)
    temps = [0.0, 1.0, 0.8, 0.0, 1.2, 0.0, 0.6, 1.0]
    seeds = [7 * seed + i for i in range(len(LENGTHS))]
    top_k = [VOCAB, 5, VOCAB, 3, 8, VOCAB, 2, VOCAB]
    got = run(drafts, dp, logits, bonus, temps, seeds, top_k=top_k)
    assert got == reference(drafts, dp, logits, bonus, temps, seeds, top_k=top_k)


def test_random_outcomes_vary_across_seeds():
    """Guards the reference comparison against a degenerate case (all accepted or all rejected everywhere)."""
    drafts, _, logits, bonus = random_case([4] * 8, 0)
    temps = [1.0] * 8
    accepted = {
        sum(t != PLACEHOLDER_TOKEN_ID for t in row) - 1
        for s in range(6)
        for row in run(drafts, None, logits, bonus, temps, [s * 10 + i for i in range(8)])
    }
    assert len(accepted) >= 3, accepted


@pytest.mark.parametrize("n_match", [0, 1, 2, 3, 4])
def test_greedy_accepts_exactly_the_matching_prefix_then_bonus(n_match):
    g = torch.Generator().manual_seed(n_match)
    logits = torch.randn(4, VOCAB, generator=g)
    argmax = logits.argmax(-1).tolist()
    draft = [argmax[j] if j < n_match else (argmax[j] + 1) % VOCAB for j in range(4)]
    # A second request with no drafts gets its bonus token at column 0.
    out = run([draft, []], None, torch.cat([logits]), [99 % VOCAB, 7], [0.0, 0.0])
    if n_match == 4:
        expected = draft + [99 % VOCAB]
    else:
        expected = draft[:n_match] + [argmax[n_match]] + [PLACEHOLDER_TOKEN_ID] * (4 - n_match)
    assert out[0] == expected
    assert out[1] == [7] + [PLACEHOLDER_TOKEN_ID] * 4
    assert NPURejectionSampler.parse_output(torch.tensor(out), VOCAB)[0] == [t for t in expected if t >= 0]


def test_all_requests_without_drafts_emit_only_bonus():
    for temps in ([0.0, 0.0], [1.0, 0.0], [1.0, 1.0]):
        assert run([[], []], None, torch.zeros(0, VOCAB), [3, 4], temps, [1, 2]) == [[3], [4]]


def test_rejection_sampling_reproduces_the_target_distribution():
    """The first emitted token of speculative sampling is distributed as the target distribution, whatever the
    draft distribution (Leviathan et al., Theorem 1). 40000 one-token requests in one batch."""
    torch.manual_seed(0)
    n, v = 40000, 6
    p = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.15, 0.05])
    q = torch.tensor([0.30, 0.10, 0.30, 0.10, 0.10, 0.10])
    for draft_probs in (q.expand(n, v).contiguous(), None):
        # ngram (None): the draft is deterministic, i.e. a point mass on the drafted token.
        drafted = torch.multinomial(q, n, replacement=True) if draft_probs is not None else torch.full((n,), 2)
        logits = p.log().expand(n, v).contiguous()
        out = run([[int(t)] for t in drafted], draft_probs, logits, [0] * n, [1.0] * n)
        first = torch.tensor([row[0] for row in out])
        freq = torch.bincount(first, minlength=v).double() / n
        assert torch.allclose(freq, p.double(), atol=0.015), (freq, p)


def test_dummy_sampler_run_contract():
    """What GPUModelRunner._dummy_sampler_run passes: one draft per request, 1-D int32 bonus ids, temperature 0.5,
    top-k = vocab - 1 and top-p 0.9, neither all greedy nor all random."""
    n = 5
    md = SpecDecodeMetadata.make_dummy([[0] for _ in range(n)], torch.device("cpu"))
    meta = sampling_metadata([0.5] * n, top_k=[VOCAB - 1] * n)
    meta.all_random = False
    meta.top_p = torch.full((n,), 0.9)
    out = NPURejectionSampler()(md, None, torch.randn(n, VOCAB), torch.zeros(n, dtype=torch.int32), meta)
    assert out.shape == (n, 2) and out.dtype == torch.int32
    assert ((out[:, 0] >= 0) & (out[:, 0] < VOCAB)).all()


def test_max_spec_len_over_vllm_limit_is_refused():
    md = SpecDecodeMetadata.make_dummy([[1] * 129], torch.device("cpu"))
    with pytest.raises(ValueError, match="MAX_SPEC_LEN"):
        NPURejectionSampler()(
            md, None, torch.randn(129, VOCAB), torch.zeros(1, 1, dtype=torch.int32), sampling_metadata([0.0])
        )


@pytest.mark.parametrize(("top_k", "top_p"), [([5, VOCAB], None), ([5, 3], [0.9, 1.0]), (None, [0.5, 0.9])])
def test_target_probs_read_no_device_tensor(top_k: list[int] | None, top_p: list[float] | None) -> None:
    """Top-k/top-p of the target probabilities without a host read of a device tensor (an NPU host sync per step):
    vLLM's ``apply_top_k_only`` reads ``k.max()``; on meta tensors any data read raises."""
    from vllm_npu.platform.sample.rejection_sampler import compute_probs

    meta = sampling_metadata([0.8, 1.0], top_k=top_k, top_p=top_p)
    for name in ("temperature", "top_k", "top_p"):
        if getattr(meta, name) is not None:
            setattr(meta, name, getattr(meta, name).to("meta"))
    logits = torch.empty(5, VOCAB, device="meta")
    probs = compute_probs(logits, torch.tensor([2, 5], device="meta"), meta)
    assert probs.shape == (5, VOCAB) and probs.dtype == torch.float32
