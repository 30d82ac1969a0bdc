# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPURejectionSampler: vLLM 0.11's speculative-decoding ``RejectionSampler`` with its Triton kernels in plain torch.

vLLM's ``vllm/v1/sample/rejection_sampler.py`` launches Triton kernels (``expand_kernel``,
``rejection_greedy_sample_kernel``, ``rejection_random_sample_kernel``, ``sample_recovered_tokens_kernel``), which
exist neither on the Ascend NPU nor on the emulated CPU device. This subclass keeps vLLM's contract (constructor,
``forward``, ``parse_output``) and its device-neutral Python logic (``generate_uniform_probs``; top-k/top-p as
vLLM's ``apply_top_k_top_p`` through :func:`.topk_topp.top_k_top_p_reference`, a sort without vLLM's host read of
``k.max()``), and computes each kernel step as batched tensor ops over a ``[batch_size, max_spec_len]``
padded view of the flattened draft tokens. The only Python loops are the per-seeded-request random draws that
vLLM itself does per request (reproducibility).

Semantics (those of vLLM's kernels, https://arxiv.org/abs/2211.17192):

- greedy request: position ``j`` emits the target argmax; the first position where the draft differs from it is
  the last emitted one (a "recovered" argmax); if every draft token matches, the bonus token follows.
- random request: draft token ``d`` at position ``j`` is accepted iff ``p_draft(d) > 0`` and
  ``p_target(d) / p_draft(d) >= u_j`` (``p_draft = 1`` when the proposer gives no probabilities, e.g. ngram); the
  first rejected position emits the recovered token ``argmax(max(p_target - p_draft, 0) / q)`` (ngram:
  ``argmax(p_target with d zeroed / q)``), where ``q ~ Exp(1)`` is one vocab-sized draw per request (a Gumbel-style
  sample from the normalised residual distribution); if all are accepted, the bonus token follows.
- every other slot of the ``[batch_size, max_spec_len + 1]`` int32 output is ``PLACEHOLDER_TOKEN_ID`` (-1).

One deliberate difference: vLLM 0.11 marks greedy requests in a mixed batch by ``temperature == -1``, but its
``InputBatch`` writes ``0.0`` for greedy requests, so vLLM's own sampler divides greedy logits by zero (fixed
upstream by vllm-project/vllm#27077, which made the marker 0). Here a request is greedy if its temperature is
``0`` or ``-1``, and both are replaced by 1 before the temperature division.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN, RejectionSampler, generate_uniform_probs
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from .topk_topp import top_k_top_p_reference

#: Output slot of a rejected / unused position (vLLM's value; ``parse_output`` filters it out).
PLACEHOLDER_TOKEN_ID = -1
#: Temperatures that mark a greedy request in ``SamplingMetadata.temperature`` (0.0: vLLM 0.11's InputBatch;
#: -1: the marker vLLM 0.11's rejection sampler expects).
GREEDY_TEMPERATURES = (0.0, -1.0)


class NPURejectionSampler(RejectionSampler):
    """vLLM's ``RejectionSampler`` (same constructor, ``forward`` and ``parse_output``) computed in torch."""

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """Verify the draft tokens of a batch.

        Args:
            metadata: ``draft_token_ids`` [num_tokens] int, ``num_draft_tokens`` (list, per request),
                ``cu_num_draft_tokens`` [batch_size] int (inclusive cumulative sums), ``max_spec_len``.
            draft_probs: [num_tokens, vocab] draft probabilities, or None (ngram: no probabilities).
            target_logits: [num_tokens, vocab] target-model logits at the draft positions; may be updated in place.
            bonus_token_ids: [batch_size, 1] or [batch_size] int, the token sampled after the last draft position.
            sampling_metadata: temperatures, top-k/top-p, per-request generators, ``all_greedy``/``all_random``.

        Returns:
            [batch_size, max_spec_len + 1] int32 output token ids, ``PLACEHOLDER_TOKEN_ID`` where nothing is emitted.
        """
        _check_spec_len(metadata)
        target_probs = compute_probs(target_logits, metadata.cu_num_draft_tokens, sampling_metadata)
        return rejection_sample(
            metadata.draft_token_ids,
            metadata.num_draft_tokens,
            metadata.max_spec_len,
            metadata.cu_num_draft_tokens,
            draft_probs,
            target_probs,
            bonus_token_ids,
            sampling_metadata,
        )


class NPURejectionSamplerWithSampler(RejectionSampler):
    """vLLM 0.11.1's ``RejectionSampler`` (built with the model runner's sampler; ``forward`` samples the bonus tokens
    itself, applies the per-request logits processors to the target logits and returns a ``SamplerOutput`` with the
    accepted tokens' logprobs) with its Triton kernels in torch: the same steps, the verification through
    :func:`compute_probs` and :func:`rejection_sample` of this module. The type checker sees 0.11.0's base class.
    In the processed-logprobs mode the logprobs come from the target logits after the logits processors and the
    temperature, before top-k/top-p (vLLM's are after top-k/top-p too)."""

    def forward(  # type: ignore[override]
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> Any:
        """``logits`` [num_tokens + batch_size, vocab]: the target model's logits at the draft positions and the bonus
        positions (``metadata.target_logits_indices`` / ``bonus_logits_indices``). Returns vLLM's ``SamplerOutput``:
        [batch_size, max_spec_len + 1] int32 token ids (``PLACEHOLDER_TOKEN_ID`` where nothing is emitted)."""
        from dataclasses import replace

        from vllm.v1.outputs import SamplerOutput

        _check_spec_len(metadata)
        this = cast(Any, self)  # 0.11.1's attributes and methods, unknown to the type checker
        bonus = this.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            logprobs_mode_override="processed_logits" if this.is_processed_logprobs_mode else "raw_logits",
        )
        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = this.apply_logits_processors(raw_target_logits, sampling_metadata, metadata)
        target_probs = compute_probs(target_logits, metadata.cu_num_draft_tokens, sampling_metadata)
        output_token_ids = rejection_sample(
            metadata.draft_token_ids,
            metadata.num_draft_tokens,
            metadata.max_spec_len,
            metadata.cu_num_draft_tokens,
            draft_probs,
            target_probs,
            bonus.sampled_token_ids,
            sampling_metadata,
        )
        logprobs = None
        if sampling_metadata.max_num_logprobs:
            logprobs = this._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs,
                metadata,
                logits,
                target_logits if this.is_processed_logprobs_mode else raw_target_logits,
                bonus.logprobs_tensors.logprobs,
                output_token_ids,
            )
        return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=logprobs)


def _check_spec_len(metadata: SpecDecodeMetadata) -> None:
    if metadata.max_spec_len > MAX_SPEC_LEN:
        raise ValueError(
            f"NPURejectionSampler: max_spec_len {metadata.max_spec_len} exceeds vLLM's MAX_SPEC_LEN "
            f"{MAX_SPEC_LEN}; lower speculative_config.num_speculative_tokens"
        )


def make_rejection_sampler(sampler: Any) -> RejectionSampler:
    """The rejection sampler for the installed vLLM: 0.11.1's takes the model runner's sampler (read off vLLM's
    constructor), 0.11.0's takes nothing."""
    import inspect

    if "sampler" in inspect.signature(RejectionSampler.__init__).parameters:
        return cast(Any, NPURejectionSamplerWithSampler)(sampler)
    return NPURejectionSampler()


# --- probabilities ------------------------------------------------------------------------------------------------


def _draft_counts(cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """[batch_size] int64 draft-token counts from the inclusive cumulative sums (stays on the device: no sync)."""
    cu = cu_num_draft_tokens.to(torch.int64)
    return torch.diff(cu, prepend=cu.new_zeros(1))


def _is_greedy(temperature: torch.Tensor) -> torch.Tensor:
    """[batch_size] bool: requests whose temperature is one of ``GREEDY_TEMPERATURES``."""
    greedy = torch.zeros_like(temperature, dtype=torch.bool)
    for v in GREEDY_TEMPERATURES:
        greedy |= temperature == v
    return greedy


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Repeat per-request ``x`` [batch_size] to per-token [num_tokens] (``cu_num_tokens``: inclusive cumsum;
    vLLM's ``expand_kernel``)."""
    return torch.repeat_interleave(x, _draft_counts(cu_num_tokens), output_size=num_tokens)


def compute_probs(
    logits: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """[num_tokens, vocab] target probabilities: the logits themselves when ``all_greedy`` (only their argmax is
    used), else ``softmax(top_k_top_p(logits / T))`` in float32 with greedy requests at ``T = 1``. ``logits`` is
    divided in place (as in vLLM)."""
    if sampling_metadata.all_greedy:
        return logits
    num_tokens = logits.shape[0]
    temperature = sampling_metadata.temperature
    assert temperature is not None  # vLLM leaves it None only when every request is greedy
    temperature = expand_batch_to_tokens(
        temperature.masked_fill(_is_greedy(temperature), 1), cu_num_draft_tokens, num_tokens
    )
    logits.div_(temperature.unsqueeze(-1))
    top_k = top_p = None
    if sampling_metadata.top_k is not None:
        top_k = expand_batch_to_tokens(sampling_metadata.top_k, cu_num_draft_tokens, num_tokens)
    if sampling_metadata.top_p is not None:
        top_p = expand_batch_to_tokens(sampling_metadata.top_p, cu_num_draft_tokens, num_tokens)
    if top_k is not None or top_p is not None:
        # vLLM's apply_top_k_top_p would read k.max() on the host for top-k alone (apply_top_k_only): a sync per step
        logits = top_k_top_p_reference(logits, top_k, top_p)
    return logits.softmax(dim=-1, dtype=torch.float32)


# --- rejection sampling -------------------------------------------------------------------------------------------


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """vLLM's ``rejection_sample`` (same arguments and result) without Triton; see the module docstring."""
    batch_size = len(num_draft_tokens)
    num_tokens = draft_token_ids.shape[0]
    device = target_probs.device
    if draft_token_ids.ndim != 1 or target_probs.ndim != 2 or target_probs.shape[0] != num_tokens:
        raise ValueError(
            f"rejection_sample: draft_token_ids must be [num_tokens] and target_probs [num_tokens, vocab]; got "
            f"{tuple(draft_token_ids.shape)} and {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"rejection_sample: draft_probs {tuple(draft_probs.shape)} must match target_probs "
            f"{tuple(target_probs.shape)}"
        )
    if cu_num_draft_tokens.shape != (batch_size,) or bonus_token_ids.numel() != batch_size:
        raise ValueError(
            f"rejection_sample: {batch_size} requests but cu_num_draft_tokens {tuple(cu_num_draft_tokens.shape)} "
            f"and bonus_token_ids {tuple(bonus_token_ids.shape)}"
        )
    bonus = bonus_token_ids.reshape(batch_size).to(torch.int32)

    counts = _draft_counts(cu_num_draft_tokens).to(device)  # [B]
    pos = torch.arange(max_spec_len, device=device)  # [K]
    valid = pos.unsqueeze(0) < counts.unsqueeze(1)  # [B, K]
    # Flat index of (request, position) into the [num_tokens] arrays; padded slots point at token 0 (masked).
    flat = ((cu_num_draft_tokens.to(device, torch.int64) - counts).unsqueeze(1) + pos).masked_fill(~valid, 0)
    draft = draft_token_ids.to(torch.int64)[flat]  # [B, K]

    temperature = sampling_metadata.temperature  # None exactly when all_greedy (vLLM's input batch)
    is_greedy = None if sampling_metadata.all_greedy or temperature is None else _is_greedy(temperature)

    greedy_out = None
    if not sampling_metadata.all_random:
        target_argmax = target_probs.argmax(dim=-1)[flat]
        # Accepted while the draft equals the target argmax; the first mismatch emits the argmax itself.
        greedy_out = _emit(draft == target_argmax, target_argmax, target_argmax, valid, counts, bonus)
        if is_greedy is None:
            return greedy_out

    uniform_probs = generate_uniform_probs(num_tokens, num_draft_tokens, sampling_metadata.generators, device)
    recovered = sample_recovered_tokens(
        num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, sampling_metadata, device
    )
    target_p = target_probs[flat, draft]  # [B, K]
    uniform = uniform_probs[flat]
    if draft_probs is None:
        accept = target_p >= uniform  # draft probability 1
    else:
        draft_p = draft_probs[flat, draft]
        # A zero draft probability rejects (vLLM's guard against 0/0).
        accept = (draft_p > 0) & (target_p / draft_p >= uniform)
    random_out = _emit(accept, draft, recovered.to(torch.int64)[flat], valid, counts, bonus)
    if greedy_out is None or is_greedy is None:  # all random (a greedy-only batch returned above)
        return random_out
    return torch.where(is_greedy.to(device).unsqueeze(1), greedy_out, random_out)


def _emit(
    accept: torch.Tensor,
    accepted_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    valid: torch.Tensor,
    counts: torch.Tensor,
    bonus: torch.Tensor,
) -> torch.Tensor:
    """[B, K + 1] int32 output from per-position decisions (all [B, K]): positions before the first rejection emit
    ``accepted_tokens``, the first rejected one emits ``rejected_tokens``, a request with none rejected gets
    ``bonus`` [B] at column ``counts``; every other slot is the placeholder."""
    batch_size, k = valid.shape
    # Length of the accepted prefix: positions with no rejection at or before them (an int cumsum, which every
    # backend has, rather than a cumprod).
    rejections_so_far = (~(accept & valid)).to(torch.int32).cumsum(dim=1)
    n_accepted = (rejections_so_far == 0).sum(dim=1)  # [B]
    pos = torch.arange(k, device=valid.device).unsqueeze(0)
    n_acc = n_accepted.unsqueeze(1)
    tokens = torch.where(pos < n_acc, accepted_tokens, rejected_tokens)
    body = torch.where(valid & (pos <= n_acc), tokens, PLACEHOLDER_TOKEN_ID)
    out = torch.cat([body.to(torch.int32), body.new_full((batch_size, 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)], 1)
    all_accepted = n_accepted == counts  # [B]
    bonus_col = torch.arange(k + 1, device=valid.device).unsqueeze(0) == counts.unsqueeze(1)
    return torch.where(bonus_col & all_accepted.unsqueeze(1), bonus.unsqueeze(1), out)


def sample_recovered_tokens(
    num_draft_tokens: list[int],
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    sampling_metadata: SamplingMetadata,
    device: torch.device,
) -> torch.Tensor:
    """[num_tokens] recovered token per draft position, ``argmax(residual / q)`` with one ``q ~ Exp(1)`` [vocab]
    per request, drawn exactly as vLLM draws it (whole batch from the default generator, then each seeded request
    with at least one draft token from its own generator), so seeded requests reproduce vLLM's random stream."""
    batch_size = len(num_draft_tokens)
    num_tokens, vocab_size = target_probs.shape
    q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=device)
    q.exponential_()
    for i, generator in sampling_metadata.generators.items():
        if num_draft_tokens[i] > 0:
            q[i].exponential_(generator=generator)
    if draft_probs is None:
        # No draft distribution (ngram): the residual is the target distribution without the drafted token.
        residual = target_probs.clone()
        residual.scatter_(1, draft_token_ids.to(torch.int64).unsqueeze(1), 0)
    else:
        residual = (target_probs - draft_probs).clamp_min_(0)
    req_of_token = torch.repeat_interleave(
        torch.arange(batch_size, device=device), _draft_counts(cu_num_draft_tokens).to(device), output_size=num_tokens
    )
    # Unnormalised residual is fine: argmax is invariant to the per-row scale.
    residual.div_(q.index_select(0, req_of_token))
    return residual.argmax(dim=-1).to(draft_token_ids.dtype)
