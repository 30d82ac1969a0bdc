# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Attention backend selection: which of our backends serves a layer, as a ``"module.Class"`` path.

Import-light on purpose (no torch, no vLLM): ``NPUPlatform.get_attn_backend_cls`` calls :func:`select_backend` while
vLLM is still building its config, and vLLM resolves the returned path itself
(``vllm/attention/selector.py::_cached_get_attn_backend`` -> ``resolve_obj_by_qualname``).

Unsupported requests raise :class:`~vllm_npu.interface.ConfigError` naming the cause and the fix; returning an
empty string would only make vLLM fail later with "Invalid attention backend".
"""

from __future__ import annotations

from typing import Any

from vllm_npu.interface import ConfigError

GQA_BACKEND = "vllm_npu.attention.backends.gqa.AscendAttentionBackend"
MLA_BACKEND = "vllm_npu.attention.backends.mla.AscendMLABackend"
SFA_BACKEND = "vllm_npu.attention.backends.sfa.AscendSFABackend"

# Dtype names the backends compute in (torch dtypes print as "torch.float16"; strings are accepted as well).
_SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}
# The paged KV layout splits a block into 16-token fractal rows on the NPU; every paged kernel we call
# (FIA paged mode, paged attention) requires a multiple of 16.
_BLOCK_ALIGN = 16
_MAX_BLOCK_SIZE = 512
# KV-cache dtypes the backends store: the model dtype, and for GQA layers the int8 cache of a C8 checkpoint (the
# platform sets "int8" for those); fp8 caches are not supported.
_PLAIN_KV_CACHE_DTYPES = (None, "auto")
_C8_KV_CACHE_DTYPE = "int8"


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.").lower()
    return _DTYPE_ALIASES.get(name, name)


def select_backend(
    *,
    use_mla: bool,
    use_sparse: bool,
    has_sink: bool = False,
    head_size: int | None = None,
    dtype: Any = None,
    block_size: int | None = None,
    kv_cache_dtype: str | None = None,
) -> str:
    """Return the ``"module.Class"`` path of the attention backend for one layer configuration.

    - ``use_sparse`` (DeepSeek-V3.2 sparse attention, which is MLA-based) -> :data:`SFA_BACKEND`;
    - ``use_mla`` -> :data:`MLA_BACKEND`;
    - otherwise (MHA / GQA / MQA) -> :data:`GQA_BACKEND`.

    ``head_size``, ``dtype`` (a ``torch.dtype`` or its name), ``block_size`` and ``kv_cache_dtype`` are checked when
    given. Raises :class:`ConfigError` for combinations no backend serves: attention sinks, sparse attention
    without MLA, an fp8 KV cache, an int8 (C8) KV cache on MLA, a non-positive head size, an unsupported dtype or a block size that is not a
    multiple of 16 (max 512).
    """
    if has_sink:
        raise ConfigError(
            "attention sinks (e.g. gpt-oss) are not supported by the vllm-npu attention backends; "
            "serve a model without sink tokens, or use another platform for this model"
        )
    if use_sparse and not use_mla:
        raise ConfigError(
            "sparse attention (use_sparse=True) is only defined for MLA models (DeepSeek-V3.2 style); "
            "the model config asks for sparse attention without MLA, check the checkpoint's config.json"
        )
    if head_size is not None and (not isinstance(head_size, int) or head_size <= 0):
        raise ConfigError(f"attention head_size must be a positive integer, got {head_size!r}")
    name = _dtype_name(dtype)
    if name is not None and name not in _SUPPORTED_DTYPES:
        raise ConfigError(
            f"attention dtype {name!r} is not supported; use one of {', '.join(_SUPPORTED_DTYPES)} (--dtype)"
        )
    if block_size is not None and (
        not isinstance(block_size, int) or block_size <= 0 or block_size % _BLOCK_ALIGN or block_size > _MAX_BLOCK_SIZE
    ):
        raise ConfigError(
            f"KV-cache block_size={block_size!r} is not supported: it must be a multiple of {_BLOCK_ALIGN} and at "
            f"most {_MAX_BLOCK_SIZE} (use --block-size 128, the Ascend default)"
        )
    if kv_cache_dtype == _C8_KV_CACHE_DTYPE and (use_mla or use_sparse):
        raise ConfigError(
            "an int8 KV cache (C8 checkpoint: kv_quant_type / kv_cache_type C8) is not supported for MLA models "
            "(DeepSeek-V2/V3/V3.2): the latent cache has no C8 kernel path here, and msModelSlim documents C8 for "
            "GQA models only; export the checkpoint without KV-cache quantization"
        )
    if kv_cache_dtype not in (*_PLAIN_KV_CACHE_DTYPES, _C8_KV_CACHE_DTYPE):
        raise ConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the vllm-npu attention backends; "
            "use --kv-cache-dtype auto"
        )
    if use_sparse:
        return SFA_BACKEND
    if use_mla:
        return MLA_BACKEND
    return GQA_BACKEND
