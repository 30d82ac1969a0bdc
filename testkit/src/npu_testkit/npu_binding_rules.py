# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""What torch_npu 2.8.0's bindings and kernels impose beyond the documented signatures, for the stand-in torch_npu.

The NPU-wiring tests run our NPU code paths against fakes of torch_npu. A signature check (``torch_npu_docs``) cannot
see a binding that hard-codes a mode, a kernel that needs a layout, or a dtype pairing that only a table states; each
function here checks one such rule (raising :class:`BindingRuleError`) or models one such semantic, and names its
source. Sources, all pinned:

- ``op-plugin@7.2.0``: github.com/Ascend/op-plugin branch ``7.2.0`` (commit ``738effc0``), the bindings behind
  torch_npu 2.8.0 (its README lists the ``v2.8.0-7.2.0`` build);
- ``ops-transformer``: CANN ops-transformer kernel host code (public copy ``ckorikov/cann-ops-transformer``,
  ``attention/scatter_pa_kv_cache/op_host/``);
- ``docs``: the torch_npu 2.8.0 wheel's ``torch_npu/_op_plugin_docs.py`` / ``op_plugin/atb/_atb_api_docs.py``;
- ``ATB docs``: the CANN ATB operation reference (hiascend.com ``ascendtbapi``), for ATB ops the wheel leaves
  undocumented.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import fake_npu_graphs
from .torch_npu_docs import load_docs

ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29


class BindingRuleError(AssertionError):
    """A call the real binding or kernel would reject (or silently mishandle)."""


def _require(ok: bool, rule: str, source: str) -> None:
    if not ok:
        raise BindingRuleError(f"{rule} [source: {source}]")


def documented(fn: Callable[..., Any], name: str | None = None, namespace: str = "") -> Callable[..., Any]:
    """``fn`` (a fake op) behind the documented-signature check of ``torch_npu.[atb.]<name>``: positional count,
    keyword names and required parameters as the torch_npu 2.8.0 wheel documents them (``torch_npu_docs``)."""
    op = name or fn.__name__
    docs = load_docs()

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        problems = docs.check_call(namespace, op, len(args), list(kwargs))
        _require(not problems, "; ".join(problems), "torch_npu 2.8.0 wheel docs / binding schemas")
        fake_npu_graphs.kernel_call(op, args, kwargs)  # the ACL graph rules (task groups, captured reads)
        with fake_npu_graphs.kernel_body():
            return fn(*args, **kwargs)

    return call


# --- KV-cache writes ----------------------------------------------------------------------------------------------

# Ops whose torch_npu 2.8.0 binding fixes a mode that no ND-layout caller can use: a source call is an error
# (tests/contract). Name -> why, with the source.
UNUSABLE_IN_2_8_0 = {
    "npu_scatter_pa_kv_cache": "its binding hard-codes cacheMode PA_NZ (op-plugin@7.2.0 ScatterPaKvCacheNpuOpApi.cpp:33,56); "
    "write ND caches with torch_npu._npu_reshape_and_cache",
}


def scatter_pa_kv_cache_nz_shapes(
    key: torch.Tensor, key_cache: torch.Tensor, value: torch.Tensor, value_cache: torch.Tensor
) -> None:
    """``torch_npu.npu_scatter_pa_kv_cache`` (2.8.0) always runs the kernel's ``PA_NZ`` template, whose dim checks
    require NZ-shaped caches ``[nb, Nkv * D / last, bs, last]`` with ``last = 32 / sizeof(dtype)``."""
    src = (
        'op-plugin@7.2.0 op_plugin/ops/opapi/ScatterPaKvCacheNpuOpApi.cpp:33,56 (cache_mode = "PA_NZ", no argument to '
        "change it; the 2.8.0 wheel's libtorch_npu.so holds the literal beside aclnnScatterPaKvCache); "
        "ops-transformer scatter_pa_kv_cache_tiling.cpp CheckInputDimUpdate (TEMPLATE_NZ dim checks)"
    )
    for name, x, cache in (("key", key, key_cache), ("value", value, value_cache)):
        last = 32 // cache.element_size()
        _require(
            cache.dim() == 4 and cache.shape[3] == last and cache.shape[1] == x.shape[1] * x.shape[2] // last,
            f"npu_scatter_pa_kv_cache: cacheMode is PA_NZ; dim1/dim3 of {name}Cache {tuple(cache.shape)} are invalid "
            f"(need [nb, {x.shape[1] * x.shape[2] // last}, bs, {last}])",
            src,
        )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """``torch_npu._npu_reshape_and_cache`` (ATB ReshapeAndCacheOperation), ND caches."""
    _require(
        key_cache.is_contiguous() and value_cache.is_contiguous(),
        "_npu_reshape_and_cache: the caches are outputs and must be contiguous",
        "op-plugin@7.2.0 op_plugin/utils/custom_functions/atb/AtbCommon.cpp:29 (AtTensor2AtbTensor TORCH_CHECK)",
    )
    _require(
        slot_indices.dtype == torch.int32 and slot_indices.dim() == 1 and slot_indices.shape[0] == key.shape[0],
        f"_npu_reshape_and_cache: slotMapping must be int32 [num_tokens={key.shape[0]}], got {slot_indices.dtype} "
        f"{tuple(slot_indices.shape)}",
        "ATB docs ReshapeAndCacheOperation (slotMapping [num_tokens] int32 ND)",
    )
    _require(
        key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
        and key.dtype in (torch.float16, torch.bfloat16, torch.int8),
        "_npu_reshape_and_cache: key, value and both caches must share one dtype of float16/bfloat16/int8",
        "ATB docs ReshapeAndCacheOperation constraints",
    )
    _require(
        key.dim() == 3
        and key_cache.dim() == 4
        and tuple(key_cache.shape[2:]) == tuple(key.shape[1:])
        and tuple(value_cache.shape[2:]) == tuple(value.shape[1:])
        and key_cache.shape[:2] == value_cache.shape[:2],
        f"_npu_reshape_and_cache: ND caches must be [nb, bs, Nkv, D] matching key [T, Nkv, D]; got key "
        f"{tuple(key.shape)}, key_cache {tuple(key_cache.shape)}",
        "ATB docs ReshapeAndCacheOperation; op-plugin@7.2.0 op_plugin/ops/atb/ReshapeAndCachAtb.cpp:33-37 "
        "(K_CACHE_V_CACHE unless both caches are FRACTAL_NZ)",
    )
    total = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_indices.long()
    real = slots[slots >= 0]
    _require(
        bool((slots > -total).all() and (slots < total).all()) and real.unique().numel() == real.numel(),
        "_npu_reshape_and_cache: slots must be distinct and in (-num_blocks*block_size, num_blocks*block_size)",
        "ATB docs ReshapeAndCacheOperation (slotMapping value range, no duplicates; negative slots are skipped)",
    )


# --- attention ----------------------------------------------------------------------------------------------------


def paged_attention_v2_call(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    context_lens: Sequence[int],
    mask_type: int,
    out: torch.Tensor,
) -> None:
    """``torch_npu.atb._npu_paged_attention_v2``: the binding wires only UNDEFINED (0) and ALIBI (2) masks, passes
    ``value_cache`` as an input, makes ``context_lens`` an int32 tensor; the output must be contiguous."""
    src = "op-plugin@7.2.0 op_plugin/ops/atb/PagedAttentionAtbV2.cpp:56-73"
    _require(mask_type in (0, 2), f"_npu_paged_attention_v2: mask_type {mask_type} not wired (0 or 2)", src)
    _require(value_cache is not None, "_npu_paged_attention_v2: value_cache must be given", src)
    _require(
        out.is_contiguous(),
        "_npu_paged_attention_v2: out must be contiguous",
        "op-plugin@7.2.0 op_plugin/utils/custom_functions/atb/AtbCommon.cpp:29",
    )
    bs, head = key_cache.shape[1], key_cache.shape[-1]
    docs = "docs _atb_api_docs.py _npu_paged_attention_v2 (规格约束)"
    _require(
        bs % 16 == 0 and bs <= 128 and 0 < head <= 256,
        f"_npu_paged_attention_v2: block_size {bs} must be a multiple of 16 and <= 128, head_size {head} <= 256",
        docs,
    )
    _require(
        block_table.dtype == torch.int32 and block_table.shape[0] == query.shape[0] == len(context_lens),
        "_npu_paged_attention_v2: int32 block_table and context_lens, one per query token",
        docs,
    )
    used = torch.cat([block_table[b, : -(-n // bs)] for b, n in enumerate(context_lens)])
    _require(
        bool(((used >= 0) & (used < key_cache.shape[0])).all()),
        "_npu_paged_attention_v2: block ids must be in [0, num_blocks)",
        docs,
    )


def flash_attention_v2_call(
    query: torch.Tensor, mask: torch.Tensor | None, mask_type: int, seq_len: Sequence[int], out: torch.Tensor
) -> None:
    """``torch_npu.atb._npu_flash_attention_v2`` (ATB SelfAttention, PA_ENCODER) with MASK_TYPE_NORM."""
    _require(
        out.is_contiguous(),
        "_npu_flash_attention_v2: out must be contiguous",
        "op-plugin@7.2.0 op_plugin/utils/custom_functions/atb/AtbCommon.cpp:29",
    )
    _require(
        sum(seq_len) == query.shape[0],
        "_npu_flash_attention_v2: seq_len must add up to the packed tokens",
        "op-plugin@7.2.0 op_plugin/ops/atb/SelfAttentionAtbV2.cpp (seq_len -> int32 tensor)",
    )
    _require(
        mask_type == 1 and mask is not None and mask.dtype == query.dtype and mask.shape[0] >= max(seq_len),
        "_npu_flash_attention_v2: MASK_TYPE_NORM (1) takes a [maxS, maxS] mask in the query's dtype",
        "docs _atb_api_docs.py _npu_flash_attention_v2",
    )


def fia_paged_tnd(block_size: int, query: torch.Tensor) -> None:
    """``npu_fused_infer_attention_score`` with Q_S > 1 over a paged cache: block size a multiple of 128, <= 512."""
    _require(
        block_size % 128 == 0 and 128 <= block_size <= 512 and query.dtype in (torch.float16, torch.bfloat16),
        f"npu_fused_infer_attention_score: paged Q_S > 1 needs block_size in 128..512 (multiple of 128), got "
        f"{block_size}; query float16/bfloat16",
        "docs _op_plugin_docs.py:6616 (block_size最小为128, 最大为512, 且要求是128的倍数)",
    )


RING_MLA_MODES = {
    "kernel_type": ("kernel_type_default", "kernel_type_high_precision"),
    "mask_type": ("no_mask", "mask_type_triu"),
    "input_layout": ("type_bsnd",),
    "calc_type": ("calc_type_default", "calc_type_first_ring"),
}


def ring_mla_call(q_nope: torch.Tensor, mask: torch.Tensor | None, seqlen: torch.Tensor, modes: dict[str, str]) -> None:
    """``torch_npu.atb.npu_ring_mla``: fixed mode strings, a host ``seqlen``, a ``[512, 512]`` mask in q's dtype."""
    src = "op-plugin@7.2.0 op_plugin/ops/atb/RingMlaAtb.cpp:20-37 (mode maps), :74 (seqlen CPU TORCH_CHECK)"
    for key, allowed in RING_MLA_MODES.items():
        _require(modes.get(key) in allowed, f"npu_ring_mla: {key}={modes.get(key)!r} not in {allowed}", src)
    _require(
        seqlen.device.type == "cpu" and seqlen.dtype == torch.int32,
        "npu_ring_mla: seqlen must be a CPU int32 tensor",
        src,
    )
    _require(
        q_nope.dtype in (torch.float16, torch.bfloat16),
        "npu_ring_mla: q_nope must be float16/bfloat16",
        "docs _atb_api_docs.py npu_ring_mla (q_nope 支持float16/bf16)",
    )
    if modes["mask_type"] == "mask_type_triu":
        _require(
            mask is not None and tuple(mask.shape) == (512, 512) and mask.dtype == q_nope.dtype,
            "npu_ring_mla: mask_type_triu needs a [512, 512] mask in q's dtype",
            "docs _atb_api_docs.py npu_ring_mla (mask 支持float16/bf16, shape为[512, 512])",
        )


def ring_mla_mask_bias(mask: torch.Tensor) -> torch.Tensor:
    """The additive score bias the ring-MLA kernel derives from its mask: float16 masks are added as given, bfloat16
    masks are flags multiplied by ``-3e38`` inside the kernel. So an fp16 mask must carry a large negative value where
    masked; a ``1`` there is a +1 bias, not a mask."""
    # source: op-plugin@7.2.0 test/test_custom_ops/test_atb_ring_mla.py:337-349 ("kernel中mask的系数":
    # fp16 pre_mask_coff=-10000, post_mask_coff=1; otherwise pre_mask_coff=1, post_mask_coff=-3e38)
    m = mask.to(torch.float64)
    return m if mask.dtype == torch.float16 else m * -3e38


def fia_query_s_is_one(query: torch.Tensor, input_layout: str, actual_seq_lengths: Sequence[int] | None) -> bool:
    """Whether ``npu_fused_infer_attention_score`` sees ``Q_S == 1``. For TND the docs do not say which kernel an
    all-single-token batch takes; the fakes read it the pessimistic way (every request has one query token)."""
    if input_layout == "TND":
        ends = list(actual_seq_lengths or [])
        starts = [0, *ends[:-1]]
        return bool(ends) and all(e - s == 1 for s, e in zip(starts, ends, strict=True))
    s_dim = {"BSH": 1, "BSND": 1, "BNSD": 2}[input_layout]
    return query.shape[s_dim] == 1


FIA_QS1_IGNORES = "docs _op_plugin_docs.py:6507 (pre_tokens: Q_S为1时该参数无效), :6514 (sparse_mode: Q_S为1且不带rope输入时该参数无效)"


def fia_paged_mask(mask: torch.Tensor, batch: int, block_table: torch.Tensor, block_size: int) -> None:
    """A user mask (``sparse_mode=0``) with Q_S == 1 and a paged cache: ``[B, 1, KV_S]`` bool/int8/uint8 with
    ``KV_S >= block_table.shape[1] * block_size``."""
    _require(
        mask.dtype in (torch.bool, torch.int8, torch.uint8) and mask.is_contiguous(),
        "npu_fused_infer_attention_score: atten_mask must be a contiguous bool/int8/uint8 tensor",
        "docs _op_plugin_docs.py npu_fused_infer_attention_score (atten_mask)",
    )
    _require(
        mask.dim() == 3
        and mask.shape[0] == batch
        and mask.shape[1] == 1
        and mask.shape[2] >= block_table.shape[1] * block_size,
        f"npu_fused_infer_attention_score: a Q_S=1 paged mask must be [B={batch}, 1, >= "
        f"{block_table.shape[1] * block_size}], got {tuple(mask.shape)}",
        "docs _op_plugin_docs.py:6477 (Q_S为1时建议shape输入(B, 1, KV_S)), :6689 (atten_mask的最后一维需要大于等于"
        "block_table的第二维 * block_size)",
    )


# --- quantized grouped matmul -------------------------------------------------------------------------------------

# per-token quantization with a tensor group_list (int8 x and weight, float32 per_token_scale): scale dtype -> y dtype
GROUPED_MATMUL_PER_TOKEN = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}
# per-channel quantization (int8 x and weight, int32 bias): scale dtype -> y dtype
GROUPED_MATMUL_PER_CHANNEL = {torch.int64: torch.int8, torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}
_GMM_TABLE = 'docs _op_plugin_docs.py:4488-4520 (npu_grouped_matmul, "group_list输入类型为torch.Tensor时" 表1)'


def grouped_matmul_quant_dtypes(
    scale: torch.Tensor, per_token_scale: torch.Tensor | None, output_dtype: torch.dtype, bias: torch.Tensor | None
) -> None:
    """The documented (scale, output) dtype pairs of the int8 modes of ``npu_grouped_matmul``."""
    if per_token_scale is not None:
        _require(
            per_token_scale.dtype == torch.float32, "npu_grouped_matmul: per_token_scale must be float32", _GMM_TABLE
        )
        table, mode = GROUPED_MATMUL_PER_TOKEN, "per-token"
    else:
        table, mode = GROUPED_MATMUL_PER_CHANNEL, "per-channel"
    _require(
        table.get(scale.dtype) == output_dtype,
        f"npu_grouped_matmul ({mode}): scale {scale.dtype} with output {output_dtype} is not a documented pair "
        f"({', '.join(f'{s} -> {y}' for s, y in table.items())})",
        _GMM_TABLE,
    )
    _require(bias is None or bias.dtype == torch.int32, "npu_grouped_matmul: quantized bias must be int32", _GMM_TABLE)


#: the int8 x int4 mode is outside the docs' table: the call that has run (vllm-ascend) and torchair's converter
_GMM_A8W4 = (
    "vllm-ascend v0.11.0 ops/moe/moe_mlp.py:138-187 and torchair "
    "_ge_concrete_graph/ge_converter/custom/grouped_matmul.py:27-52,96-135"
)


def grouped_matmul_a8w4(
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    per_token_scale: torch.Tensor,
    output_dtype: torch.dtype | None,
) -> None:
    """``npu_grouped_matmul`` with int8 x and int4 weights, as vllm-ascend v0.11.0 calls it
    (``ops/moe/moe_mlp.py:160-187``): int32-packed weight ``[E, K, N/8]``, int64 scale ``[E, K/g, N]`` (the GE
    converter casts it to uint64), float32 bias ``[E, N]``, float32 per-token scale, bfloat16 (or float16) output
    (the converter's ``convert_ydtype_in_a8``)."""
    e, _, n8 = weight.shape
    _require(
        scale.dtype == torch.int64 and scale.dim() == 3 and tuple(scale.shape[::2]) == (e, n8 * 8),
        f"npu_grouped_matmul (int8 x int4): scale must be int64 [E, K/g, N], got {scale.dtype} {tuple(scale.shape)}",
        _GMM_A8W4,
    )
    _require(
        bias.dtype == torch.float32 and tuple(bias.shape) == (e, n8 * 8),
        f"npu_grouped_matmul (int8 x int4): bias must be float32 [E, N], got {bias.dtype} {tuple(bias.shape)}",
        _GMM_A8W4,
    )
    _require(per_token_scale.dtype == torch.float32, "npu_grouped_matmul: per_token_scale must be float32", _GMM_A8W4)
    _require(
        output_dtype in (torch.bfloat16, torch.float16),
        f"npu_grouped_matmul (int8 x int4): output bfloat16 or float16, got {output_dtype}",
        _GMM_A8W4,
    )


# --- paged cache load ---------------------------------------------------------------------------------------------


def paged_cache_load_call(
    block_table: torch.Tensor, context_lens: torch.Tensor, seq_starts: torch.Tensor | None
) -> None:
    """``torch_npu.atb.npu_paged_cache_load``: int32 block table, lengths and starts."""
    _require(
        block_table.dtype == context_lens.dtype == torch.int32
        and (seq_starts is None or seq_starts.dtype == torch.int32),
        "npu_paged_cache_load: block_table, context_lens and seq_starts must be int32",
        "docs _atb_api_docs.py npu_paged_cache_load",
    )


PAGED_CACHE_LOAD_SYNCS = (
    "op-plugin@7.2.0 op_plugin/ops/atb/PagedCacheLoadAtb.cpp:45-50: without key=/value= the binding sizes its outputs "
    "with context_lens[i].item() per request (a device-to-host sync each)"
)


# --- formats ------------------------------------------------------------------------------------------------------


class NZFormats(TorchFunctionMode):
    """Tracks which storages a fake ``npu_format_cast`` put in FRACTAL_NZ and, while active, rejects shape-changing
    views of them: an NZ tensor's storage is blocked, and a ``.T`` / ``.view`` / ``.split`` of it is not what a
    row-major reading of the same shape means (matmuls, which understand the format, stay allowed)."""

    VIEWS = frozenset(
        {
            "view",
            "reshape",
            "t",
            "transpose",
            "permute",
            "split",
            "chunk",
            "flatten",
            "unflatten",
            "narrow",
            "unbind",
            "as_strided",
            "view_as",
            "reshape_as",
            "__getitem__",
            "T",
            "mT",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        # storage pointer -> the storage itself, held so the address is not reused while it is tracked
        self._nz: dict[int, torch.UntypedStorage] = {}

    def cast(self, tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
        """``npu_format_cast``: a new tensor (same values) in ``acl_format`` (ND or FRACTAL_NZ)."""
        _require(
            acl_format in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ),
            f"npu_format_cast: unexpected format {acl_format}",
            "docs _op_plugin_docs.py npu_format_cast",
        )
        with torch._C.DisableTorchFunction():
            out = tensor.clone()
            storage = out.untyped_storage()
        if acl_format == ACL_FORMAT_FRACTAL_NZ:
            self._nz[storage.data_ptr()] = storage
        return out

    def format_of(self, tensor: torch.Tensor) -> int:
        with torch._C.DisableTorchFunction():
            ptr = tensor.untyped_storage().data_ptr()
        return ACL_FORMAT_FRACTAL_NZ if ptr in self._nz else ACL_FORMAT_ND

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        name = getattr(func, "__name__", "")
        if name == "__get__":  # properties (.T, .mT) arrive as their getter
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if (
            name in self.VIEWS
            and args
            and isinstance(args[0], torch.Tensor)
            and self.format_of(args[0]) == ACL_FORMAT_FRACTAL_NZ
        ):
            raise BindingRuleError(
                f"{name}: reshaping a FRACTAL_NZ tensor reads its blocked storage as if it were row-major [source: "
                "vllm-ascend v0.11.0 vllm_ascend/attention/mla_v1.py:622-626 (kv_b_proj is cast back to ND before "
                "its .T/.view/.split)]"
            )
        return func(*args, **(kwargs or {}))
