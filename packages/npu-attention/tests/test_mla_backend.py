"""AscendMLABackend against dense, obviously correct attention.

The dense reference materialises every request's K and V from its latents with ``kv_b_proj``
(``k = [kv_c @ W_UK, k_pe]``, ``v = kv_c @ W_UV``) and runs plain causal softmax attention in float64. The backend
runs the real metadata builder and impl (reference kernels) on a paged cache whose blocks are scattered at random.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402
from vllm.v1.attention.backends.utils import CommonAttentionMetadata  # noqa: E402
from vllm_npu.attention.backends.mla import AscendMLABackend, AscendMLAImpl, AscendMLAMetadataBuilder  # noqa: E402
from vllm_npu.attention.ops.mla_cache import latent_cache_planes, mla_cache_write_reference  # noqa: E402
from vllm_npu.interface.device import configure_kernels  # noqa: E402
from vllm_npu.interface.errors import ConfigError  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


class KvBProj(torch.nn.Module):
    """Stand-in for vLLM's ColumnParallelLinear ``kv_b_proj`` (unquantised, TP=1): returns ``(y, None)``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()
        self.input_size_per_partition = weight.shape[1]

    def forward(self, x: torch.Tensor):
        return x @ self.weight.T.to(x.dtype), None


@dataclass
class Dims:
    N: int = 4  # heads
    L: int = 32  # kv_lora_rank
    R: int = 16  # rope dim
    P: int = 24  # qk_nope_head_dim
    V: int = 20  # v_head_dim


@dataclass
class Scenario:
    dims: Dims
    block_size: int
    reqs: list[tuple[int, int]]  # (context_len, query_len) per request, decodes first
    kv_c: list[torch.Tensor]  # per request [total, L]
    k_pe: list[torch.Tensor]  # per request [total, R]
    q: list[torch.Tensor]  # per request [q_len, N, P + R]
    w_kv_b: torch.Tensor  # [N * (P + V), L]
    block_table: torch.Tensor
    slots: list[torch.Tensor]  # per request [total]
    kv_cache: torch.Tensor
    scale: float
    pad: int


def make_scenario(reqs, block_size, *, dims=None, seed=0, pad=0, dtype=torch.float32, spare_blocks=3) -> Scenario:
    d = dims or Dims()
    g = torch.Generator().manual_seed(seed)
    totals = [c + q for c, q in reqs]
    nblk = [math.ceil(t / block_size) for t in totals]
    num_blocks = 1 + sum(nblk) + spare_blocks  # block 0 is vLLM's null block
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_table = torch.zeros(len(reqs), max(nblk) + 2, dtype=torch.int32)
    slots = []
    for b, (t, nb) in enumerate(zip(totals, nblk, strict=True)):
        ids = [perm.pop() for _ in range(nb)]
        block_table[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(t)
        slots.append(block_table[b, pos // block_size].long() * block_size + pos % block_size)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    kv_c = [rnd(t, d.L) for t in totals]
    k_pe = [rnd(t, d.R) for t in totals]
    q = [rnd(ql, d.N, d.P + d.R) for _, ql in reqs]
    w = rnd(d.N * (d.P + d.V), d.L) / math.sqrt(d.L)
    kv_cache = torch.zeros(num_blocks, block_size, d.L + d.R, dtype=dtype)
    nope, rope = latent_cache_planes(kv_cache, d.L, d.R)
    for b, (c, _) in enumerate(reqs):  # prior steps already cached the context
        mla_cache_write_reference(kv_c[b][:c], k_pe[b][:c], nope, rope, slots[b][:c])
    scale = 1.0 / math.sqrt(d.P + d.R)
    return Scenario(d, block_size, list(reqs), kv_c, k_pe, q, w, block_table, slots, kv_cache, scale, pad)


def dense_reference(s: Scenario) -> torch.Tensor:
    """``[sum(q_len), N * V]``: per request, materialise K/V from the latents and run causal softmax attention."""
    d = s.dims
    outs = []
    for b, (c, ql) in enumerate(s.reqs):
        kv = (s.kv_c[b].double() @ s.w_kv_b.double().T).view(-1, d.N, d.P + d.V)
        k_nope, v = kv.split([d.P, d.V], dim=-1)
        k = torch.cat([k_nope, s.k_pe[b].double()[:, None, :].expand(-1, d.N, -1)], dim=-1)  # [S, N, P + R]
        score = torch.einsum("qnd,knd->nqk", s.q[b].double(), k) * s.scale
        qpos = torch.arange(c, c + ql)[:, None]
        kpos = torch.arange(c + ql)[None, :]
        score = score.masked_fill(kpos > qpos, float("-inf"))
        outs.append(torch.einsum("nqk,knv->qnv", torch.softmax(score, -1), v).reshape(ql, d.N * d.V))
    return torch.cat(outs)


def make_impl(s: Scenario) -> AscendMLAImpl:
    d = s.dims
    impl = AscendMLAImpl(
        d.N, d.L + d.R, s.scale, 1, None, None, "auto", None, "decoder", None,
        q_lora_rank=None, kv_lora_rank=d.L, qk_nope_head_dim=d.P, qk_rope_head_dim=d.R,
        qk_head_dim=d.P + d.R, v_head_dim=d.V, kv_b_proj=KvBProj(s.w_kv_b),
    )  # fmt: skip
    impl.process_weights_after_loading(s.kv_cache.dtype)
    return impl


def builder_config(s: Scenario, **extra: object) -> SimpleNamespace:
    """The parts of a VllmConfig the MLA builder reads (plus ``extra`` sections)."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        cache_config=SimpleNamespace(block_size=s.block_size),
        model_config=SimpleNamespace(max_model_len=4096),
        **extra,
    )


def make_builder(s: Scenario, chunk_tokens: int | None = None) -> AscendMLAMetadataBuilder:
    spec = SimpleNamespace(block_size=s.block_size)
    builder = AscendMLAMetadataBuilder(spec, ["layer"], builder_config(s), torch.device("cpu"))
    if chunk_tokens is not None:
        builder.context_chunk_tokens = chunk_tokens
    return builder


def step_inputs(s: Scenario):
    """The tensors vLLM hands the impl for this step: new tokens of every request, then ``pad`` padding tokens."""
    d = s.dims
    q = torch.cat(s.q + [torch.randn(s.pad, d.N, d.P + d.R).to(s.q[0].dtype)])
    kv_c = torch.cat([s.kv_c[b][c:] for b, (c, _) in enumerate(s.reqs)] + [torch.randn(s.pad, d.L).to(q.dtype)])
    k_pe = torch.cat([s.k_pe[b][c:] for b, (c, _) in enumerate(s.reqs)] + [torch.randn(s.pad, d.R).to(q.dtype)])
    slot_mapping = torch.cat(
        [s.slots[b][c:] for b, (c, _) in enumerate(s.reqs)] + [torch.full((s.pad,), -1, dtype=torch.long)]
    )
    q_lens = torch.tensor([ql for _, ql in s.reqs], dtype=torch.int32)
    seq_lens = torch.tensor([c + ql for c, ql in s.reqs], dtype=torch.int32)
    qsl = torch.zeros(len(s.reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    n = int(qsl[-1])
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        num_computed_tokens_cpu=seq_lens - q_lens,
        num_reqs=len(s.reqs),
        num_actual_tokens=n,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=s.block_table,
        slot_mapping=slot_mapping,
    )
    return q, kv_c, k_pe.unsqueeze(1), slot_mapping, common


def run_backend(s: Scenario, chunk_tokens: int | None = None, builder=None):
    d = s.dims
    q, kv_c, k_pe, _, common = step_inputs(s)
    builder = builder or make_builder(s, chunk_tokens)
    meta = builder.build(0, common)
    impl = make_impl(s)
    output = torch.full((q.shape[0], d.N * d.V), 7.0, dtype=q.dtype)
    impl.forward(None, q, kv_c, k_pe, s.kv_cache, meta, output=output)
    return output, meta


def assert_close(s: Scenario, got: torch.Tensor, want: torch.Tensor) -> None:
    tol = {torch.float32: 2e-4, torch.bfloat16: 4e-2, torch.float16: 5e-3}[got.dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


# --- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 128])
def test_pure_prefill_no_cache(block_size: int) -> None:
    s = make_scenario([(0, 37), (0, 5), (0, 20)], block_size, seed=1)
    out, meta = run_backend(s)
    assert meta.num_decodes == 0 and meta.num_prefills == 3 and not meta.prefill.context_chunks
    assert_close(s, out, dense_reference(s))


@pytest.mark.parametrize("block_size", [16, 128])
def test_pure_decode(block_size: int) -> None:
    s = make_scenario([(40, 1), (3, 1), (129, 1), (0, 1)], block_size, seed=2)
    out, meta = run_backend(s)
    assert meta.num_decodes == 4 and meta.prefill is None
    assert_close(s, out, dense_reference(s))


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("seed", [3, 4])
def test_mixed_batch_with_chunked_context_and_padding(block_size: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    decodes = [(int(torch.randint(1, 300, (1,), generator=g)), 1) for _ in range(3)]
    prefills = [(int(torch.randint(0, 300, (1,), generator=g)), int(torch.randint(2, 40, (1,), generator=g))) for _ in range(3)]
    prefills.append((0, 9))  # a prefill without context next to ones with context
    s = make_scenario(decodes + prefills, block_size, seed=seed, pad=5)
    out, meta = run_backend(s, chunk_tokens=2 * block_size)  # forces several context chunks
    n = meta.num_actual_tokens
    assert meta.num_decodes == 3 and meta.num_prefills == 4
    assert len(meta.prefill.context_chunks) > 1
    assert_close(s, out[:n], dense_reference(s))
    assert torch.all(out[n:] == 0), "padding rows of the output must be zeroed (the impl fills its whole buffer)"


def test_cache_holds_every_new_token_and_padding_is_skipped() -> None:
    s = make_scenario([(10, 1), (4, 12)], 16, seed=5, pad=3)
    before = s.kv_cache.clone()
    _, kv_c, k_pe, slot_mapping, _ = step_inputs(s)
    run_backend(s)
    nope, rope = latent_cache_planes(s.kv_cache, s.dims.L, s.dims.R)
    valid = slot_mapping >= 0
    torch.testing.assert_close(nope.view(-1, s.dims.L)[slot_mapping[valid]], kv_c[valid])
    torch.testing.assert_close(rope.view(-1, s.dims.R)[slot_mapping[valid]], k_pe[valid, 0])
    changed = (s.kv_cache != before).any(-1).view(-1)
    # nothing but the new tokens' slots changed (padding slots -1 wrote nothing; block 0 untouched)
    assert int(changed.sum()) <= 2 * int(valid.sum())
    assert not (nope[0] != 0).any() and not (rope[0] != 0).any()


def test_impl_leaves_the_cache_to_a_layer_that_writes_it() -> None:
    """With ``layer_writes_cache`` (the fused MLA layer wrote kv_c/k_pe already) the impl must not write again."""
    s = make_scenario([(10, 1), (4, 12)], 16, seed=8)
    q, kv_c, k_pe, _, common = step_inputs(s)
    meta = make_builder(s).build(0, common)
    impl = make_impl(s)
    impl.layer_writes_cache = True
    before = s.kv_cache.clone()
    impl.forward(None, q, kv_c, k_pe, s.kv_cache, meta, output=torch.zeros(q.shape[0], s.dims.N * s.dims.V))
    assert torch.equal(s.kv_cache, before)


def test_chunking_does_not_change_the_result() -> None:
    s = make_scenario([(200, 30), (77, 3)], 16, seed=6)
    one, m1 = run_backend(s, chunk_tokens=10_000)
    s2 = make_scenario([(200, 30), (77, 3)], 16, seed=6)
    many, m2 = run_backend(s2, chunk_tokens=32)
    assert len(m1.prefill.context_chunks) == 1 and len(m2.prefill.context_chunks) == 13
    torch.testing.assert_close(one, many, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    s = make_scenario([(50, 1), (20, 17)], 16, seed=7, dtype=dtype)
    out, _ = run_backend(s, chunk_tokens=32)
    assert out.dtype == dtype
    assert_close(s, out, dense_reference(s))


def test_profile_run_zero_fills() -> None:
    s = make_scenario([(0, 4)], 16)
    impl = make_impl(s)
    out = torch.ones(4, s.dims.N * s.dims.V)
    impl.forward(None, torch.zeros(4, s.dims.N, s.dims.P + s.dims.R), None, None, torch.tensor([]), None, output=out)
    assert torch.all(out == 0)


def test_backend_declarations() -> None:
    assert AscendMLABackend.get_kv_cache_shape(10, 16, 1, 48) == (10, 16, 48)
    assert AscendMLABackend.get_builder_cls() is AscendMLAMetadataBuilder
    assert AscendMLABackend.get_impl_cls() is AscendMLAImpl
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        AscendMLABackend.get_kv_cache_shape(10, 16, 2, 48)
    with pytest.raises(ValueError, match="fp8"):
        AscendMLABackend.get_kv_cache_shape(10, 16, 1, 48, cache_dtype_str="fp8")


def test_builder_never_touches_the_model() -> None:
    """The builder's inputs are the KV spec, the config and CommonAttentionMetadata only (vllm-ascend#5385)."""
    import inspect

    from vllm_npu.attention.backends import mla

    src = inspect.getsource(mla.AscendMLAMetadataBuilder)
    assert "model_runner" not in src and "rotary_emb" not in src and "get_model" not in src


def test_builder_rejects_decode_context_parallel() -> None:
    s = make_scenario([(0, 4)], 16)
    cfg = builder_config(s, parallel_config=SimpleNamespace(decode_context_parallel_size=2))
    with pytest.raises(ConfigError, match="decode_context_parallel_size=1"):
        AscendMLAMetadataBuilder(SimpleNamespace(block_size=s.block_size), ["layer"], cfg, torch.device("cpu"))
