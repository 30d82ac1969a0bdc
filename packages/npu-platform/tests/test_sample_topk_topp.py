# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Top-k / top-p: the kernel pair ``TOP_K_TOP_P`` against vLLM's masking, the sampler's choice of the NPU op (host
side k range, no device read), vLLM's seeded sampling kept, and the NPU op's wiring against a stand-in torch_npu that
checks the documented contract of ``npu_top_k_top_p(logits, p, k)``."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from npu_testkit.torch_npu_docs import load_docs
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p
from vllm_npu.platform.model_runner import NPUModelRunner
from vllm_npu.platform.sample.topk_topp import (
    NPU_TOP_K_MAX,
    TOP_K_TOP_P,
    NPUTopKTopPSampler,
    top_k_top_p_npu,
    top_k_top_p_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _logits(batch: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _vllm(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's forward_native masking on the float32 values (vLLM's sampler works on float32 logits)."""
    return apply_top_k_top_p(logits.float().clone(), None if k is None else k.clone(), p)


KP = {
    "k only": (torch.tensor([1, 5, 40, 1024, 3000, 4096]), None),
    "p only": (None, torch.tensor([0.0, 0.3, 0.5, 0.9, 0.99, 1.0])),
    "k and p": (torch.tensor([1, 5, 40, 1024, 3000, 4096]), torch.tensor([0.0, 0.3, 0.5, 0.9, 0.99, 1.0])),
    # k == vocab is how vLLM's persistent batch writes "no top-k" for a row among top-k rows
    "k=V rows": (torch.tensor([4096, 7, 4096, 4096, 2, 4096]), torch.tensor([1.0, 1.0, 0.7, 1.0, 1.0, 0.2])),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(KP))
def test_reference_equals_vllm_masking(dtype: torch.dtype, name: str) -> None:
    k, p = KP[name]
    if p is not None:
        p = p.to(dtype).float()  # the op takes p in the logits' dtype
    logits = _logits(6, 4096, dtype)
    before = logits.clone()
    got = top_k_top_p_reference(logits, None if k is None else k.int(), p)
    assert got.dtype == dtype and got.shape == logits.shape
    assert torch.equal(logits, before), "the reference must not modify its input"
    want = _vllm(logits, k, p)
    # Per row the same kept values; in half precision equal logits (ties) are common, and where top-p's cut falls
    # between tied values, which of them it keeps depends on the sort's order of ties (the op's docs: a stable sort;
    # vLLM's sort: unstable). Without ties (float32) the very same entries.
    assert torch.equal(got.float().sort(-1).values, want.sort(-1).values)
    if dtype == torch.float32:
        assert torch.equal(got, want)


def test_reference_needs_k_or_p() -> None:
    with pytest.raises(ValueError, match="needs k or p"):
        top_k_top_p_reference(_logits(2, 8, torch.float32), None, None)


def _masked_probs(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return _vllm(logits, k, p).softmax(-1)


def test_distribution_over_many_seeds() -> None:
    """Per-request generators, 3000 seeds: the empirical token frequencies match the masked softmax, and no masked
    token is ever drawn."""
    vocab, draws = 12, 3000
    logits = _logits(2, vocab, torch.float32, seed=3)
    k, p = torch.tensor([5, vocab], dtype=torch.int32), torch.tensor([0.9, 0.75])
    sampler = NPUTopKTopPSampler(use_npu_kernel=False)
    counts = torch.zeros(2, vocab)
    for seed in range(draws):
        gens = {i: torch.Generator().manual_seed(seed * 2 + i) for i in range(2)}
        tokens, _ = sampler(logits.clone(), gens, k.clone(), p)
        counts[torch.arange(2), tokens] += 1
    want = _masked_probs(logits, k, p)
    assert torch.all(counts[want == 0] == 0)
    # 3000 draws: the standard error of a frequency is <= 0.0092; 4.5 of them
    assert (counts / draws - want).abs().max() < 0.042


def test_seeded_sampling_reproducible_and_equal_to_vllm_native() -> None:
    logits = _logits(4, 512, torch.float32, seed=5)
    k, p = torch.tensor([3, 512, 40, 100], dtype=torch.int32), torch.tensor([0.9, 0.5, 1.0, 0.8])
    ours, native = NPUTopKTopPSampler(use_npu_kernel=False), TopKTopPSampler()

    def run(sampler: Any, seed: int) -> torch.Tensor:
        gens = {i: torch.Generator().manual_seed(seed + i) for i in range(4)}
        return sampler.forward_native(logits.clone(), gens, k.clone(), p)[0]

    for seed in (0, 7, 1234):
        assert torch.equal(run(ours, seed), run(ours, seed))
        assert torch.equal(run(ours, seed), run(native, seed))


def test_processed_logits_are_the_masked_logits() -> None:
    logits = _logits(2, 64, torch.float32)
    k, p = torch.tensor([4, 10], dtype=torch.int32), torch.tensor([1.0, 0.6])
    _, out = NPUTopKTopPSampler("processed_logits", use_npu_kernel=False)(logits.clone(), {}, k, p)
    assert torch.equal(out, _vllm(logits, k, p))


# --- the NPU op: choice and wiring ----------------------------------------------------------------------------------


def _documented_top_k_top_p(logits: torch.Tensor, p: torch.Tensor | None, k: torch.Tensor | None) -> torch.Tensor:
    """The torch_npu 2.8.0 docs' formula, step by step, in float64."""
    value, index = logits.double().sort(dim=-1, stable=True)
    if k is not None:
        threshold = value[torch.arange(value.shape[0]), value.shape[1] - k.long()].unsqueeze(1)
        value = value.masked_fill(value < threshold, float("-inf"))
    if p is not None:
        drop = value.softmax(-1).cumsum(-1) <= 1 - p.double().unsqueeze(1)
        drop[:, -1] = False
        value = value.masked_fill(drop, float("-inf"))
    out = torch.empty_like(value)
    out.scatter_(1, index, value)
    return out.to(logits.dtype)


class FakeTorchNPU(types.ModuleType):
    """``torch_npu`` with only ``npu_top_k_top_p``: the documented signature, dtype, shape and k-range rules."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.docs = load_docs()
        self.calls: list[tuple[Any, ...]] = []

    def npu_top_k_top_p(self, *a: Any, **kw: Any) -> torch.Tensor:
        assert not self.docs.check_call("", "npu_top_k_top_p", len(a), list(kw))
        logits, p, k = a
        assert logits.dim() == 2 and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert p is not None or k is not None, "p and k may not both be None"
        if p is not None:
            assert p.dtype == logits.dtype and p.shape == (logits.shape[0],)
        if k is not None:
            assert k.dtype == torch.int32 and k.shape == (logits.shape[0],)
            assert int(k.min()) >= 1 and int(k.max()) <= min(NPU_TOP_K_MAX, logits.shape[1]), "k outside [1, 1024]"
        self.calls.append((logits.dtype, p is not None, k is not None))
        return _documented_top_k_top_p(logits, p, k)


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNPU:
    fake = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["k only", "p only", "k and p"])
def test_npu_twin_calls_the_op_as_documented(fake_npu: FakeTorchNPU, dtype: torch.dtype, name: str) -> None:
    k, p = KP[name]
    k = None if k is None else k.clamp(max=NPU_TOP_K_MAX)
    logits = _logits(6, 4096, dtype)
    got = top_k_top_p_npu(logits, k, p)  # int64 k and float32 p, as vLLM's metadata has them
    assert fake_npu.calls == [(dtype, p is not None, k is not None)]
    want = top_k_top_p_reference(logits, k, p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got, want)


def test_kernel_pair() -> None:
    assert TOP_K_TOP_P.npu is top_k_top_p_npu and TOP_K_TOP_P.reference is top_k_top_p_reference


@pytest.mark.parametrize(
    ("k_max", "with_k", "op"),
    [(50, True, True), (NPU_TOP_K_MAX, True, True), (NPU_TOP_K_MAX + 1, True, False), (None, True, False)]
    + [(None, False, True)],
)
def test_sampler_uses_the_op_within_its_host_known_k_range(
    fake_npu: FakeTorchNPU, k_max: int | None, with_k: bool, op: bool
) -> None:
    """The op within k in [1, 1024] as the host knows it (the runner's host_top_k), the sort beyond it or when the
    step's k range is not known; top-p alone always goes to the op. Same tokens either way."""
    vocab = 4096
    logits = _logits(3, vocab, torch.float32, seed=9)
    k_value = k_max if k_max is not None else 2000
    k = torch.tensor([1, 7, k_value], dtype=torch.int32) if with_k else None
    p = torch.tensor([0.9, 0.8, 0.95])
    sampler = NPUTopKTopPSampler(use_npu_kernel=True)
    gens = {i: torch.Generator().manual_seed(i) for i in range(3)}
    with sampler.host_top_k(k_max):
        tokens, _ = sampler(logits.clone(), gens, k, p)
    assert bool(fake_npu.calls) == op
    gens = {i: torch.Generator().manual_seed(i) for i in range(3)}
    assert torch.equal(tokens, TopKTopPSampler().forward_native(logits.clone(), gens, k, p)[0])


def test_choice_reads_no_device_tensor() -> None:
    """The k-range check must not read k (a per-step host sync on an NPU): meta tensors raise on any data read."""
    sampler = NPUTopKTopPSampler(use_npu_kernel=True)
    logits, k = torch.empty(4, 151936, device="meta"), torch.empty(4, dtype=torch.int32, device="meta")
    with sampler.host_top_k(50):
        assert sampler.uses_npu_kernel(logits, k)
    with sampler.host_top_k(151936):
        assert not sampler.uses_npu_kernel(logits, k)
    assert not sampler.uses_npu_kernel(logits, k)  # outside host_top_k: unknown, the sort


@pytest.mark.parametrize(("backend", "npu"), [("npu", True), ("reference", False)])
def test_the_process_kernel_backend_selects(monkeypatch: pytest.MonkeyPatch, backend: str, npu: bool) -> None:

    monkeypatch.setattr("vllm_npu.interface.device._kernel_backend", [backend])
    assert NPUTopKTopPSampler().use_npu_kernel is npu


class _Batch:
    def __init__(self, top_k: list[int], no_top_k: bool) -> None:
        self.top_k_cpu = torch.tensor(top_k + [99999] * 4, dtype=torch.int32).numpy()  # stale slots past num_reqs
        self.num_reqs, self.no_top_k = len(top_k), no_top_k


@pytest.mark.parametrize(
    ("top_k", "no_top_k", "want"), [([5, 300, 7], False, 300), ([8], True, None), ([], True, None)]
)
def test_runner_states_the_host_k_max(top_k: list[int], no_top_k: bool, want: int | None) -> None:
    runner = types.SimpleNamespace(
        sampler=types.SimpleNamespace(topk_topp_sampler=NPUTopKTopPSampler()), input_batch=_Batch(top_k, no_top_k)
    )
    sampler = runner.sampler.topk_topp_sampler
    with NPUModelRunner._host_top_k(runner):  # type: ignore[arg-type]
        assert sampler._host_k_max == want
    assert sampler._host_k_max is None


@pytest.mark.parametrize("with_p", [False, True])
def test_sort_fallback_reads_no_device_tensor(with_p: bool) -> None:
    """The fallback (beyond k 1024, and the emulated device's path) has no host read either; vLLM's native top-k-only
    path does (``apply_top_k_only``: ``k.max()``)."""
    logits, k = torch.empty(4, 4096, device="meta"), torch.empty(4, dtype=torch.int32, device="meta")
    p = torch.empty(4, device="meta") if with_p else None
    tokens, _ = NPUTopKTopPSampler(use_npu_kernel=False)(logits, {}, k, p)
    assert tokens.shape == (4,)
    if not with_p:
        with pytest.raises(RuntimeError, match="meta"):
            TopKTopPSampler().forward_native(logits, {}, k, p)
