# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``MultiHeadLatentAttention`` override: the k-norm, k rope and latent-cache write in one fused kernel.

vLLM's ``MultiHeadLatentAttention.forward_native`` normalises the latent (``kv_a_layernorm``), rotates ``k_pe`` and
``q_pe`` (GPT-J style, in place) and hands them to the attention layer, whose impl then writes the cache. On Ascend
the norm, the rope of ``k_pe`` and the write are one kernel (``npu_kv_rmsnorm_rope_cache``), so this override:

1. projects q and the raw ``kv_a_proj`` output exactly like vLLM;
2. rotates ``q_pe`` with the interleave-rope kernel and writes ``kv_c`` / ``k_pe`` through the fused kernel
   (:data:`~.mla_cache.KV_RMSNORM_ROPE_CACHE`), both taking cos/sin of the layer's own rotary embedding;
3. calls the attention layer with the normalised latent and rotated ``k_pe``; its impl was told at construction that
   the layer writes the cache (:attr:`AscendMLAImpl.layer_writes_cache`).

The interleave rope leaves the rope channels de-interleaved (NeoX order) in both q and k: every q.k product is the
one of vLLM's GPT-J rotation. cos/sin come from ``rotary_emb.cos_sin_cache`` (every vLLM rotary embedding has it,
DeepSeek's YaRN mscale included), read inside the layer that owns it: the metadata builder stays model-free.

Falls back to vLLM's ``forward_native`` whenever the fusion does not apply: sparse (DeepSeek-V3.2) layers, a NeoX
rope, partial rotary, a biased norm, an attention backend other than :class:`AscendMLABackend`, or a model Dynamo
traces (PIECEWISE graphs, the torchair mode). The fused write sits outside the attention op and reads the step's
metadata in Python (whether there is any, ``num_actual_tokens``, the slot mapping): Dynamo would freeze those at its
first (metadata-less) run and never write the cache again; ``forward_native`` leaves the write to the impl: inside
the attention op, which runs eagerly between PIECEWISE graph pieces, or (torchair) in the impl's graph decode path,
on the compiled step's graph inputs (:meth:`AscendMLAImpl._graph_forward`). There the impl de-interleaves q_pe and
k_pe (:attr:`AscendMLAImpl.rope_deinterleaved`), so the latent cache holds the fused kernel's channel order in every
graph mode: a PD decode node in the torchair mode reads what an eager prefill node wrote. vllm-ascend's torchair MLA fuses the
decode step's write instead (docs/torchair.md says why ours does not).

A FULL_DECODE_ONLY graph captures this forward as it runs with the capture batch's metadata, and everything it
reads stays right on replay: the slot mapping is a view of vLLM's persistent slot buffer (rewritten in place every
step, ``-1`` past the step's tokens, which the write skips), ``positions`` is the model's input buffer, and the
token count is the graph's padded batch size, whose padding rows go to slot ``-1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm_npu.interface import Kernel

from ..backends.mla import AscendMLAImpl, AscendMLAMetadata
from .mla_base import VllmMLALayer
from .mla_cache import KV_RMSNORM_ROPE_CACHE, interleave_rope_reference, latent_cache_planes


def interleave_rope_npu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NPU twin of :func:`~.mla_cache.interleave_rope_reference` for ``x [T, N, R]``, ``cos``/``sin`` ``[T, 1, R]``
    (``torch_npu.npu_interleave_rope`` on ``[T, N, 1, R]``; documented by its meta registration)."""
    import torch_npu

    T, N, R = x.shape
    out = torch_npu.npu_interleave_rope(
        x.reshape(T, N, 1, R).contiguous(), cos.reshape(T, 1, 1, R), sin.reshape(T, 1, 1, R)
    )
    return out.view(T, N, R)


INTERLEAVE_ROPE = Kernel("interleave_rope", npu=interleave_rope_npu, reference=interleave_rope_reference)


def _model_is_traced() -> bool:
    """Whether the model being built is traced by Dynamo: PIECEWISE graphs (Dynamo pieces) or the torchair mode
    (``torch.compile`` of the decode forward). FULL_DECODE_ONLY graphs capture the eager module as it runs."""
    from vllm.config import get_current_vllm_config
    from vllm_npu.interface import NO_COMPILATION, AdditionalConfig, compilation_level

    config = get_current_vllm_config()
    if compilation_level(config.compilation_config) not in (None, NO_COMPILATION):
        return True
    extra = config.additional_config  # the platform refused a non-object --additional-config already
    return AdditionalConfig.from_vllm(extra if isinstance(extra, Mapping) else None).graph_mode == "torchair"


def _fusable(layer: VllmMLALayer) -> bool:
    """Whether the layer's norm, rope and cache write fit the fused kernel, whether or not the model is traced."""
    rope = layer.rotary_emb
    norm = layer.kv_a_layernorm
    return (
        not layer.is_sparse
        and isinstance(getattr(layer.mla_attn, "impl", None), AscendMLAImpl)
        and isinstance(getattr(rope, "cos_sin_cache", None), torch.Tensor)
        and getattr(rope, "is_neox_style", True) is False
        and getattr(rope, "rotary_dim", None) == layer.qk_rope_head_dim
        and isinstance(getattr(norm, "weight", None), torch.Tensor)
        and getattr(norm, "bias", None) is None
        and hasattr(norm, "variance_epsilon")
    )


class AscendMultiHeadLatentAttention(VllmMLALayer):
    """Registered for vLLM's MLA layer (``MultiHeadLatentAttention``, ``MultiHeadLatentAttentionWrapper`` from 0.11.1;
    :mod:`.mla_base`) through ``CustomOp.register_oot``, by the attention layer's hooks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        fusable = _fusable(self)
        self.fused_cache_write = fusable and not _model_is_traced()
        impl = self.mla_attn.impl
        if self.fused_cache_write and isinstance(impl, AscendMLAImpl):  # _fusable checked the impl is ours
            impl.layer_writes_cache = True
            self._rope = INTERLEAVE_ROPE.select()
            self._norm_rope_write = KV_RMSNORM_ROPE_CACHE.select()
        elif fusable and isinstance(impl, AscendMLAImpl):
            # Traced: vLLM's forward_native rotates GPT-J style; the impl stores the fused kernel's channel order.
            impl.rope_deinterleaved = True

    def _fused_inputs(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``rotary_emb.cos_sin_cache``, ``kv_a_layernorm.weight`` and its epsilon, typed (``_fusable`` checked them)."""
        cache, weight, eps = (
            self.rotary_emb.cos_sin_cache,
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.variance_epsilon,
        )
        assert isinstance(cache, torch.Tensor) and isinstance(weight, torch.Tensor) and isinstance(eps, int | float)
        return cache, weight, float(eps)

    def forward_oot(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.fused_cache_write:
            return self.forward_native(positions, hidden_states)
        ctx = get_forward_context()
        # vLLM types this with v0's AttentionMetadata marker, which no v1 metadata class (ours or vLLM's) subclasses.
        metadata: object = ctx.attn_metadata
        meta = metadata.get(self.mla_attn.layer_name) if isinstance(metadata, dict) else metadata
        if not isinstance(meta, AscendMLAMetadata):  # None: profile / dummy run, no cache to write (impl zero-fills)
            return self.forward_native(positions, hidden_states)

        # Which projections exist depends on q_lora_rank (as in vLLM's forward_native, which asserts the same).
        if self.q_lora_rank is not None:
            fused_qkv_a, q_a_norm, q_b = self.fused_qkv_a_proj, self.q_a_layernorm, self.q_b_proj
            assert fused_qkv_a is not None and q_a_norm is not None and q_b is not None
            q_c, kv_lora = fused_qkv_a(hidden_states)[0].split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
            )
            q = q_b(q_a_norm(q_c))[0]
        else:
            kv_a, q_proj = self.kv_a_proj_with_mqa, self.q_proj
            assert kv_a is not None and q_proj is not None
            kv_lora = kv_a(hidden_states)[0]
            q = q_proj(hidden_states)[0]
        T = hidden_states.shape[0]
        q = q.view(T, self.num_heads, self.qk_head_dim)

        cos_sin_cache, norm_weight, norm_eps = self._fused_inputs()
        half = cos_sin_cache.index_select(0, positions.long()).to(q.dtype)
        cos, sin = half.chunk(2, dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [T, R] full width
        q = torch.cat(
            (q[..., : self.qk_nope_head_dim], self._rope(q[..., self.qk_nope_head_dim :], cos[:, None], sin[:, None])),
            dim=-1,
        )

        n = meta.num_actual_tokens
        nope, rope = latent_cache_planes(
            self.mla_attn.kv_cache[ctx.virtual_engine], self.kv_lora_rank, self.qk_rope_head_dim
        )
        k_pe, kv_c = self._norm_rope_write(
            kv_lora[:n].contiguous(), norm_weight, cos[:n], sin[:n], meta.slot_mapping[:n], nope, rope, norm_eps,
        )  # fmt: skip
        attn_out = self.mla_attn(q, kv_c, k_pe.unsqueeze(1), output_shape=(T, self.num_heads * self.v_head_dim))
        return self.o_proj(attn_out)[0]
