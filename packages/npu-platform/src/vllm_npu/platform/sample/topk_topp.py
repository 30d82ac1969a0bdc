# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Top-k / top-p masking on the NPU (``torch_npu.npu_top_k_top_p``) and the sampler module that uses it.

Contract of the kernel pair :data:`TOP_K_TOP_P`, ``top_k_top_p(logits, k, p) -> masked`` (torch_npu 2.8.0 docs of
``npu_top_k_top_p(logits, p, k)``; note the op's ``(p, k)`` order): ``logits [B, V]`` float32/float16/bfloat16;
``k [B]`` integer top-k per row, ``1 <= k <= V`` (``k == V`` keeps the whole row), or None; ``p [B]`` float top-p per
row in ``[0, 1]`` (taken in the logits' dtype, as the op requires), or None; not both None. Returns a new ``[B, V]`` tensor of ``logits.dtype`` (``logits`` is not
modified): per row, logits below the k-th largest are ``-inf``; then, over the softmax of what is left, the values
whose ascending cumulative probability is ``<= 1 - p`` are ``-inf`` too, the largest always kept. Ties of the k-th
largest value are all kept. The NPU op takes ``k`` only in ``[1, 1024]``; callers use the reference twin (a sort,
as vllm-ascend's fallback does) beyond that.

vLLM 0.11 runs ``TopKTopPSampler.forward_native`` on every platform but CUDA and CPU: a full-vocabulary sort, and for
top-k alone ``apply_top_k_only``, whose ``logits.topk(k.max())`` reads a device tensor on the host every step.
:class:`NPUTopKTopPSampler` keeps vLLM's sampling step (its ``random_sample``: per-request generators, seeded
reproducibility) and replaces only the masking. Whether the NPU op may take this step's ``k`` is decided on the host
from the persistent batch's host copy of ``k`` (:meth:`NPUTopKTopPSampler.host_top_k`), not by reading ``k.max()``
from the device as vllm-ascend v0.11.0 does (``vllm_ascend/sample/sampler.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from vllm.config.model import LogprobsMode  # where 0.11.0 defines it; 0.11.1 no longer re-exports it
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, random_sample
from vllm_npu.interface import Kernel

#: The largest top-k ``npu_top_k_top_p`` accepts (torch_npu 2.8.0 docs: k in [1, 1024]).
NPU_TOP_K_MAX = 1024


def _check_args(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> None:
    if k is None and p is None:
        raise ValueError("top_k_top_p needs k or p (both None: nothing to mask; callers return the logits as they are)")
    if logits.dim() != 2:
        raise ValueError(f"top_k_top_p takes logits [batch, vocab], got shape {tuple(logits.shape)}")


def top_k_top_p_npu(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """:data:`TOP_K_TOP_P` on the NPU. The op wants ``p`` in the logits' dtype and ``k`` as int32; ``max(k)`` must be
    at most ``min(1024, V)`` (the caller's check, made on the host)."""
    import torch_npu

    _check_args(logits, k, p)
    p_arg = None if p is None else p.to(logits.dtype)
    k_arg = None if k is None else k.to(torch.int32)
    # The op's order is (logits, p, k), as vllm-ascend v0.11.0 calls it (vllm_ascend/sample/sampler.py).
    return torch_npu.npu_top_k_top_p(logits, p_arg, k_arg)


def top_k_top_p_reference(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """:data:`TOP_K_TOP_P` in torch, the steps of the op's documented formula (stable ascending sort, k-th largest
    threshold, softmax and ascending cumsum of the kept values for top-p, scatter back) in float32. No host sync (the
    per-row k is a gathered index), any ``k`` in ``1..V``: also the fallback beyond the NPU op's k range."""
    _check_args(logits, k, p)
    sorted_logits, order = logits.float().sort(dim=-1, descending=False, stable=True)
    if k is not None:
        kth = sorted_logits.gather(-1, (sorted_logits.size(-1) - k.long()).unsqueeze(-1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - p.to(logits.dtype).float().unsqueeze(-1)  # p as the op takes it: logits' dtype
        drop[:, -1] = False  # the largest value always stays
        sorted_logits.masked_fill_(drop, float("-inf"))
    return sorted_logits.scatter(-1, order, sorted_logits).to(logits.dtype)


TOP_K_TOP_P = Kernel("top_k_top_p", npu=top_k_top_p_npu, reference=top_k_top_p_reference)


class NPUTopKTopPSampler(TopKTopPSampler):
    """vLLM's ``TopKTopPSampler`` (``forward_native``: mask, then ``random_sample`` with the per-request generators)
    with the masking of :data:`TOP_K_TOP_P`: the NPU op when the process's kernels are the NPU's and this step's
    ``k`` is known on the host to be within the op's range, else the reference twin (a sort; on an NPU too).

    The model runner states the step's largest ``k`` with :meth:`host_top_k` around the sampler call; a call without
    it (vLLM's dummy sampler run) uses the reference.
    """

    def __init__(self, logprobs_mode: LogprobsMode = "raw_logprobs", use_npu_kernel: bool | None = None) -> None:
        super().__init__(logprobs_mode)
        # vLLM picks forward_native on this platform already; say so rather than rely on its platform checks.
        self.forward = self.forward_native
        self.use_npu_kernel = TOP_K_TOP_P.select() is top_k_top_p_npu if use_npu_kernel is None else use_npu_kernel
        self._host_k_max: int | None = None

    @contextmanager
    def host_top_k(self, k_max: int | None) -> Iterator[None]:
        """Within the block, the sampler's ``k`` (if any) has ``max(k) == k_max`` (host-side knowledge, e.g. the
        persistent batch's ``top_k_cpu``); None: unknown."""
        previous, self._host_k_max = self._host_k_max, k_max
        try:
            yield
        finally:
            self._host_k_max = previous

    def uses_npu_kernel(self, logits: torch.Tensor, k: torch.Tensor | None) -> bool:
        """Whether this call's masking goes to the NPU op (no device read: the k range comes from the host)."""
        if not self.use_npu_kernel:
            return False
        if k is None:
            return True
        k_max = self._host_k_max
        return k_max is not None and 1 <= k_max <= min(NPU_TOP_K_MAX, logits.shape[-1])

    def apply_top_k_top_p_npu(
        self, logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
    ) -> torch.Tensor:
        if k is None and p is None:
            return logits
        if self.uses_npu_kernel(logits, k):
            return top_k_top_p_npu(logits, k, p)
        return top_k_top_p_reference(logits, k, p)

    def forward_native(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.apply_top_k_top_p_npu(logits, k, p)
        logits_to_return = None
        if self.logprobs_mode == "processed_logits":
            logits_to_return = logits
        elif self.logprobs_mode == "processed_logprobs":
            logits_to_return = logits.log_softmax(dim=-1, dtype=torch.float32)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return random_sample(probs, generators), logits_to_return
