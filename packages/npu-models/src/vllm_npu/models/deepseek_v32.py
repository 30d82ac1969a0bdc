# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""DeepSeek-V3.2 (sparse attention with a lightning indexer) on Ascend: an override of vLLM 0.11's model class.

vLLM 0.11 serves the ``DeepseekV32ForCausalLM`` architecture with ``deepseek_v2.DeepseekV3ForCausalLM``; a config
with ``index_topk`` turns on the sparse path, which is CUDA-only in three places:

1. ``DeepseekV2Model.__init__`` allocates the shared ``topk_indices_buffer`` with ``device="cuda"``;
2. every ``Indexer`` keeps its keys in an fp8 cache (``DeepseekV32IndexerCache``: uint8 values + fp32 scales) served
   by ``DeepseekV32IndexerBackend``, whose metadata builder queries CUDA device properties;
3. ``Indexer.forward`` quantises the index queries to fp8 and calls the DeepGEMM-based ``sparse_attn_indexer`` op.

:class:`AscendDeepseekV32ForCausalLM` keeps everything else of vLLM's class (layers, MoE, weight loading) and changes
exactly those: it builds vLLM's model with explicit ``"cuda"`` allocations redirected to the device the model is
being built on (vLLM offers no seam for the buffer's device), then gives every sparse attention layer an
:class:`AscendIndexer`: the same projection modules (so checkpoints load unchanged), a model-dtype key cache served by
npu-attention's ``AscendSFAIndexerBackend``, and ``ascend_indexer_forward`` ending in one ``AscendLightningIndexer``
per layer, called through one opaque custom op (``torch.ops.vllm.npu_dsa_lightning_indexer``, the counterpart of
vLLM's ``sparse_attn_indexer`` op) so that graph capture never traces its per-step metadata reads. Sparse attention itself runs in npu-attention's ``AscendSFABackend`` (chosen by the platform for
``use_sparse`` layers), which reads the indexer's ``topk_indices_buffer``.

KV-cache dtype: vLLM's config hook for this architecture (``vllm/model_executor/models/config.py``) turns
``cache_dtype="auto"`` into ``"fp8_ds_mla"``, which no Ascend backend stores; the platform resets it to ``"auto"``
(npu-platform ``check_and_update_config``). ``--kv-cache-dtype bfloat16`` also ends as ``"auto"`` through that hook.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from vllm.config import VllmConfig
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2MLAAttention,
    DeepseekV3ForCausalLM,
    DeepseekV32IndexerCache,
    Indexer,
)
from vllm.model_executor.models.utils import PPMissingLayer

# npu-attention is a declared dependency of npu-models (see its pyproject: this override reuses the SFA
# implementation, which is not a contract the interface could hold), so a plain import through attention's door.
from vllm_npu.attention import AscendLightningIndexer, AscendSFAImpl, AscendSFAIndexerBackend, ascend_indexer_forward
from vllm_npu.interface import ConfigError, get_logger

logger = get_logger(__name__)


class _RedirectCudaAllocations(TorchFunctionMode):
    """Inside the block, torch calls given ``device="cuda"``/``"cuda:N"`` allocate on ``device`` instead.

    Scoped to the construction of vLLM's model (see the module doc, point 1); calls without an explicit CUDA
    device are untouched (vLLM's loader already puts those on the target device).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.redirected: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs = {**kwargs, "device": self.device}
            self.redirected.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


@contextmanager
def redirect_cuda_allocations(device: torch.device) -> Iterator[_RedirectCudaAllocations]:
    """Context manager form of :class:`_RedirectCudaAllocations`; yields the mode (``.redirected`` lists the calls)."""
    mode = _RedirectCudaAllocations(device)
    with mode:
        yield mode


class AscendIndexerKeyCache(DeepseekV32IndexerCache):
    """The indexer key cache of one layer on Ascend: one ``index_head_dim`` key per token in the model dtype,
    ``[num_blocks, block_size, index_head_dim]``, served by npu-attention's ``AscendSFAIndexerBackend``.

    A subclass of vLLM's class on purpose: vLLM's model runner finds the indexer cache layers by that type
    (``GPUModelRunner.get_kv_cache_spec``), and its spec (``MLAAttentionSpec`` with one head) is already right once
    head size and dtype are the plain ones. Only the backend differs.
    """

    # vLLM annotates an AttentionBackend instance; every implementation (its own included) returns the class.
    def get_attn_backend(self) -> type:  # type: ignore[override]
        return AscendSFAIndexerBackend


class AscendIndexer(torch.nn.Module):
    """Replaces vLLM's ``Indexer`` in one sparse attention layer; built from it (:meth:`from_vllm`).

    Holds the same modules under the same names (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``: the checkpoint's
    ``...self_attn.indexer.*`` weights load unchanged) and fields (``n_head``, ``head_dim``, ``rope_dim``,
    ``softmax_scale``, ``topk_tokens``, ``topk_indices_buffer``), a model-dtype :class:`AscendIndexerKeyCache` as
    ``k_cache`` and one ``AscendLightningIndexer``. ``forward(hidden_states [T, hidden], qr [T, q_lora_rank],
    positions [T], rotary_emb)`` fills ``topk_indices_buffer[:T]`` with int32 request-local positions (-1 = none)
    and returns the buffer, like vLLM's; ``rotary_emb`` must be the one bound at build (:meth:`bind_rotary_emb`).
    """

    def __init__(
        self,
        *,
        wq_b: torch.nn.Module,
        wk: torch.nn.Module,
        k_norm: torch.nn.Module,
        weights_proj: torch.nn.Module,
        n_head: int,
        head_dim: int,
        rope_dim: int,
        softmax_scale: float,
        topk_tokens: int,
        topk_indices_buffer: torch.Tensor,
        prefix: str,
        dtype: torch.dtype,
        cache_config: Any,
    ) -> None:
        super().__init__()
        if topk_indices_buffer is None or topk_indices_buffer.shape[1] != topk_tokens:
            raise ConfigError(
                f"{prefix}: topk_indices_buffer must be [max_num_batched_tokens, index_topk={topk_tokens}], got "
                f"{None if topk_indices_buffer is None else tuple(topk_indices_buffer.shape)}"
            )
        self.wq_b, self.wk, self.k_norm, self.weights_proj = wq_b, wk, k_norm, weights_proj
        self.n_head, self.head_dim, self.rope_dim = n_head, head_dim, rope_dim
        self.softmax_scale = softmax_scale
        self.topk_tokens = topk_tokens
        self.topk_indices_buffer = topk_indices_buffer
        self.prefix = prefix
        self.k_cache = AscendIndexerKeyCache(
            head_dim=head_dim, dtype=dtype, prefix=f"{prefix}.k_cache", cache_config=cache_config
        )
        self.k_cache.__dict__["_owner"] = weakref.ref(self)  # not a child module: the cache layer stays a leaf
        self.lightning = AscendLightningIndexer(topk_tokens)

    @classmethod
    def from_vllm(cls, indexer: Indexer, vllm_config: VllmConfig) -> AscendIndexer:
        """Take over ``indexer``'s modules and fields, and its cache layer's name: vLLM's fp8 cache layer is removed
        from the forward context (``static_forward_context``) so that only ours gets a KV cache."""
        ctx = vllm_config.compilation_config.static_forward_context
        old_cache = indexer.k_cache
        if ctx.get(old_cache.prefix) is old_cache:
            del ctx[old_cache.prefix]
        dtype, buffer = vllm_config.model_config.dtype, indexer.topk_indices_buffer
        if not isinstance(dtype, torch.dtype):  # ModelConfig resolves "auto"/strings to a torch.dtype at init
            raise ConfigError(f"DeepSeek-V3.2 indexer {indexer.prefix}: model dtype {dtype!r} is not resolved")
        if buffer is None:
            raise ConfigError(f"DeepSeek-V3.2 indexer {indexer.prefix}: vLLM built it without a topk_indices_buffer")
        return cls(
            wq_b=indexer.wq_b,
            wk=indexer.wk,
            k_norm=indexer.k_norm,
            weights_proj=indexer.weights_proj,
            n_head=indexer.n_head,
            head_dim=indexer.head_dim,
            rope_dim=indexer.rope_dim,
            softmax_scale=indexer.softmax_scale,
            topk_tokens=indexer.topk_tokens,
            topk_indices_buffer=buffer,
            prefix=indexer.prefix,
            dtype=dtype,
            cache_config=vllm_config.cache_config,
        )

    def bind_rotary_emb(self, rotary_emb: torch.nn.Module) -> None:
        """The attention layer's rotary embedding (the one ``forward`` is called with), kept outside the module tree
        (it is the attention layer's child) so that the opaque op can reach it."""
        self.__dict__["_rotary_emb"] = rotary_emb

    def forward(
        self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rotary_emb: Any
    ) -> torch.Tensor:
        if rotary_emb is not self.__dict__.get("_rotary_emb"):
            raise ConfigError(f"{self.prefix}: called with a rotary embedding other than the bound one")
        # One opaque op (like vLLM's sparse_attn_indexer): under graph capture its metadata reads stay at run time.
        torch.ops.vllm.npu_dsa_lightning_indexer(
            hidden_states, qr, positions, self.topk_indices_buffer, self.k_cache.prefix
        )
        return self.topk_indices_buffer

    def run(self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The indexer step itself (eager): npu-attention's ``ascend_indexer_forward``."""
        return ascend_indexer_forward(self, hidden_states, qr, positions, self.__dict__["_rotary_emb"], self.lightning)


def _lightning_indexer_op(
    hidden_states: torch.Tensor,
    qr: torch.Tensor,
    positions: torch.Tensor,
    topk_indices_buffer: torch.Tensor,
    layer_name: str,
) -> None:
    """Body of ``torch.ops.vllm.npu_dsa_lightning_indexer``: find the layer's indexer through its key-cache layer
    in the forward context and run it (fills ``topk_indices_buffer[:T]``).

    The indexer writes its own buffer, which the sparse attention reads. In a functionalized graph (the torchair
    mode's compiled decode) the op is handed a copy of that buffer instead, which the graph writes back into the
    buffer afterwards: the copy then gets the indexer's result too, so the write-back keeps it."""
    from vllm.forward_context import get_forward_context

    cache = get_forward_context().no_compile_layers[layer_name]
    owner = cache.__dict__.get("_owner")
    indexer = owner() if owner is not None else None
    if indexer is None:
        raise ConfigError(f"{layer_name} is not the key cache of a live AscendIndexer")
    own = indexer.topk_indices_buffer
    if topk_indices_buffer is not own and (
        topk_indices_buffer.shape != own.shape or topk_indices_buffer.dtype != own.dtype
    ):
        raise ConfigError(
            f"{layer_name}: the indexer op was given a topk buffer {tuple(topk_indices_buffer.shape)} "
            f"{topk_indices_buffer.dtype}, not its indexer's {tuple(own.shape)} {own.dtype}"
        )
    indexer.run(hidden_states, qr, positions)
    if topk_indices_buffer is not own:
        topk_indices_buffer.copy_(own)


def _lightning_indexer_fake(
    hidden_states: torch.Tensor,
    qr: torch.Tensor,
    positions: torch.Tensor,
    topk_indices_buffer: torch.Tensor,
    layer_name: str,
) -> None:
    return None


def _register_op() -> None:
    from vllm.platforms import current_platform
    from vllm_npu.interface import import_moved

    # vLLM 0.11.1 split vllm.utils into submodules.
    direct_register_custom_op = import_moved("direct_register_custom_op", "vllm.utils.torch_utils", "vllm.utils")

    direct_register_custom_op(
        op_name="npu_dsa_lightning_indexer",
        op_func=_lightning_indexer_op,
        mutates_args=["topk_indices_buffer"],
        fake_impl=_lightning_indexer_fake,
        dispatch_key=current_platform.dispatch_key,
    )


_register_op()  # once per process: this module is imported once


class AscendDeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """vLLM's DeepSeek-V3.2 model (``DeepseekV3ForCausalLM`` with ``index_topk``) on Ascend; see the module doc."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        if not hasattr(config, "index_topk"):
            raise ConfigError(
                "DeepseekV32ForCausalLM needs index_topk, index_n_heads and index_head_dim in config.json; a "
                "checkpoint without them is dense DeepSeek-V3: set architectures to ['DeepseekV3ForCausalLM']"
            )
        # The loader builds the model under `with torch.device(target)`: that is the current device.
        device = torch.get_default_device()
        with redirect_cuda_allocations(device) as mode:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        if mode.redirected:
            logger.debug("DeepSeek-V3.2: %d CUDA allocation(s) redirected to %s", len(mode.redirected), device)

        for layer in self.model.layers:
            if isinstance(layer, PPMissingLayer):
                continue
            attn = layer.self_attn
            if not isinstance(attn, DeepseekV2MLAAttention):
                raise ConfigError(f"{type(attn).__name__}: expected vLLM's MLA attention in a DeepSeek-V3.2 layer")
            if not isinstance(attn.indexer, Indexer):
                raise ConfigError(f"{attn.indexer!r}: expected vLLM's Indexer in a DeepSeek-V3.2 attention layer")
            impl = attn.mla_attn.mla_attn.impl
            if not isinstance(impl, AscendSFAImpl):
                raise ConfigError(
                    f"DeepSeek-V3.2 sparse attention runs on AscendSFABackend; layer {attn.indexer.prefix} got "
                    f"{type(impl).__name__} (check that the platform selects the NPU attention backends)"
                )
            new = AscendIndexer.from_vllm(attn.indexer, vllm_config)
            new.bind_rotary_emb(attn.rotary_emb)
            # Every holder of the indexer: the attention module, the MLA layer (which calls it) and the sparse
            # attention impl (which reads its topk_indices_buffer). vLLM types the attribute as its Indexer class;
            # ours stands in for it with the same call (hidden_states, qr, positions, rotary_emb), not as a subclass.
            attn.indexer = new  # type: ignore[assignment]
            attn.mla_attn.indexer = new
            impl.indexer = new
