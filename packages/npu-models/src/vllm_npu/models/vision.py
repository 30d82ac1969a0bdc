# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU path of the Qwen vision towers' attention (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE).

vLLM's vision attention (``Qwen2VisionAttention``, ``Qwen2_5_VisionAttention``; Qwen3-VL reuses the latter) picks its
kernel from ``get_vit_attn_backend`` among FLASH_ATTN / TORCH_SDPA / XFORMERS, all CUDA or plain torch. On the NPU
the block's attention is instead:

1. the fused ``qkv`` projection and vLLM's own ``split_qkv`` (its tensor-parallel gather included);
2. the vision rotary embedding on q and k through npu-ops' ``rotary_mul_qk`` kernel (``npu_rotary_mul``,
   rotate-half mode, cos/sin ``[1, S, 1, D]``), the maths of vLLM's ``apply_rotary_pos_emb_vision`` (fp32 inside);
3. npu-attention's ``vision_attention`` kernel (``_npu_flash_attention_unpad``) over the packed sequences, whose
   per-sequence int32 lengths it reads on the host;
4. vLLM's ``proj``.

The subclasses here change only ``forward``; a tower built by vLLM is converted in place by
:func:`adopt_vision_attention` (vLLM builds each attention inside its block with no factory seam, and rebuilding the
blocks would allocate the tower twice). The cos/sin of the tower's rotary table and the host-side lengths of each
``cu_seqlens`` are computed once per tower forward and shared by all blocks (:class:`TensorMemo`).

Head-dim padding (``pad_head_dim=True``, as vllm-ascend v0.11.0 does for Qwen2-VL and Qwen2.5-VL): head dims in
(64, 128) — 80 in the released Qwen2/2.5-VL towers — are padded to 128 once, after the weights are loaded
(:func:`pad_vision_heads`): each head's q/k/v rows of the fused ``qkv`` weight and bias become
``[first half, zeros, second half, zeros]`` and the matching input columns of ``proj`` likewise, and cos/sin are
padded the same way. Rotate-half then pairs the same elements, the zero lanes contribute exactly 0 to every dot
product and to the output, and the softmax scale stays ``original_head_dim ** -0.5``: the layer's result is
unchanged. Only done where the attention holds all heads (vision TP 1) and its linears are unquantised; elsewhere
the tower runs unpadded, which is equally correct.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionAttention
from vllm.model_executor.models.qwen2_vl import Qwen2VisionAttention

# npu-attention and npu-ops are declared dependencies of npu-models (see its pyproject); imported through their doors.
from vllm_npu.attention import VISION_ATTENTION
from vllm_npu.interface import ConfigError
from vllm_npu.ops import ROTARY_MUL_QK

#: The head dims vllm-ascend v0.11.0 pads (exclusive bounds) and the width they are padded to.
PAD_MIN, PAD_TO = 64, 128


class TensorMemo:
    """Remembers ``compute(t)`` for the last ``slots`` tensors it saw: a hit needs the very same tensor object with
    the same version counter (no in-place write since; inference tensors have none, and then identity decides:
    vLLM's towers build these tensors afresh every forward and never write them in place). Holding the tensor keeps
    its identity from being reused.

    One memo is shared by all blocks of a tower: Qwen2.5-VL alternates two ``cu_seqlens`` tensors (window and full
    attention), so two slots; every tower forward builds new tensors, so nothing outlives it in effect."""

    __slots__ = ("_entries", "_slots", "computed")

    def __init__(self, slots: int = 2) -> None:
        self._entries: list[tuple[torch.Tensor, int | None, Any]] = []
        self._slots = slots
        self.computed = 0  # how many times ``compute`` ran (tests read it)

    def get(self, t: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
        try:
            version: int | None = t._version
        except RuntimeError:  # inference tensors (vLLM runs under inference_mode) do not track versions
            version = None
        for held, held_version, value in self._entries:
            if held is t and held_version == version:
                return value
        value = compute(t)
        self.computed += 1
        self._entries = [(t, version, value), *self._entries][: self._slots]
        return value


class _NPUVisionAttention:
    """The NPU ``forward`` of a Qwen vision attention (mixed into subclasses of vLLM's classes; see the module doc).

    ``forward(x [S, B, E], cu_seqlens [n + 1] int32, rotary_pos_emb [S, D / 2] fp32 or None, max_seqlen, seqlens)
    -> [S, B, E]`` with vLLM's signature (its blocks call it unchanged); ``max_seqlen`` / ``seqlens`` are the
    FLASH_ATTN / XFORMERS extras and unused here. Attributes set by :func:`adopt_vision_attention`:
    ``npu_head_dim`` (the width the kernels see), ``npu_scale``, the selected kernels, the shared memos.
    """

    # Set by adopt_vision_attention (instances are vLLM's, re-classed; see the module doc).
    npu_head_dim: int
    npu_scale: float
    npu_pad: bool
    npu_wants_pad: bool
    npu_cos_sin: TensorMemo
    npu_seq_lens: TensorMemo
    npu_calls: int
    _rotary_mul_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    _vision_attention: Callable[..., None]

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None,
        max_seqlen: int | None = None,
        seqlens: list[int] | None = None,
    ) -> torch.Tensor:
        vllm: Any = self  # vLLM's half of the class: qkv, split_qkv, proj
        qkv, _ = vllm.qkv(x)
        q, k, v = vllm.split_qkv(qkv)  # each [S, B, N, D]
        s, b, n, d = q.shape
        # The kernels take batch-major [B, S, N, D] (BSND); the towers run one packed sequence (B = 1).
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        if rotary_pos_emb is not None:
            cos, sin = self.npu_cos_sin.get(rotary_pos_emb, self._cos_sin)
            q, k = self._rotary_mul_qk(q, k, cos.to(q.dtype), sin.to(q.dtype), "half")
        q, k, v = (t.reshape(b * s, n, d) for t in (q, k, v))
        seq_lens = self.npu_seq_lens.get(cu_seqlens, _seq_lens)
        out = torch.empty_like(q)
        self._vision_attention(q, k, v, seq_lens, num_heads=n, num_kv_heads=n, scale=self.npu_scale, out=out)
        self.npu_calls += 1
        context = out.view(b, s, n * d).transpose(0, 1)  # [S, B, N * D]
        output, _ = vllm.proj(context)
        return output

    def _cos_sin(self, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[1, S, 1, npu_head_dim]`` fp32 in rotate-half layout from the rotary angles ``[S, D / 2]``."""
        cos, sin = freqs.float().cos(), freqs.float().sin()
        if self.npu_pad:
            # Each half of a padded head is [original half, zeros]: cos/sin get the same zero tail per half.
            tail = self.npu_head_dim // 2 - cos.shape[-1]
            cos, sin = (nn.functional.pad(t, (0, tail)) for t in (cos, sin))
        cos, sin = (torch.cat((t, t), dim=-1)[None, :, None, :] for t in (cos, sin))
        return cos, sin


def _seq_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence lengths, int32 on the host, from the cumulative ``[n + 1]`` offsets (the kernel's ``seq_len``)."""
    return cu_seqlens.diff().to(device="cpu", dtype=torch.int32)


class AscendQwen2VisionAttention(_NPUVisionAttention, Qwen2VisionAttention):
    """Qwen2-VL's vision attention on the NPU kernels (vLLM's module, only ``forward`` differs)."""


class AscendQwen2_5_VisionAttention(_NPUVisionAttention, Qwen2_5_VisionAttention):
    """Qwen2.5-VL's (and Qwen3-VL's) vision attention on the NPU kernels (vLLM's module, only ``forward`` differs)."""


_OVERRIDES: dict[type[nn.Module], type[nn.Module]] = {
    Qwen2VisionAttention: AscendQwen2VisionAttention,
    Qwen2_5_VisionAttention: AscendQwen2_5_VisionAttention,
}


def _vision_attentions(tower: nn.Module) -> Iterator[Any]:
    """Each block's attention (typed ``Any``: vLLM's modules, with the attributes this module sets on them)."""
    blocks: Any = tower.blocks
    for block in blocks:
        yield block.attn


def adopt_vision_attention(tower: nn.Module, *, pad_head_dim: bool) -> int:
    """Turn every block's attention of a vLLM Qwen vision ``tower`` (``.blocks[i].attn``) into its NPU subclass,
    in place (same parameters and state), with the kernels of this process's backend; returns how many.

    ``pad_head_dim`` marks the tower for :func:`pad_vision_heads` (done after the weights are loaded); until then
    the attention runs at the original head dim. An attention class without an NPU subclass is an error."""
    rotary, attention = ROTARY_MUL_QK.select(), VISION_ATTENTION.select()
    cos_sin, seq_lens = TensorMemo(slots=1), TensorMemo(slots=2)
    count = 0
    for attn in _vision_attentions(tower):
        base = type(attn)
        npu_cls = _OVERRIDES.get(base)
        if npu_cls is None:
            if isinstance(attn, _NPUVisionAttention):
                continue
            raise ConfigError(
                f"no NPU vision attention for {base.__module__}.{base.__qualname__}: npu-models knows "
                f"{sorted(c.__qualname__ for c in _OVERRIDES)}; this vLLM build differs from the one npu-models supports"
            )
        attn.__class__ = npu_cls
        head_dim = attn.hidden_size_per_attention_head
        attn.npu_head_dim, attn.npu_scale, attn.npu_pad = head_dim, head_dim**-0.5, False
        attn.npu_wants_pad = pad_head_dim and PAD_MIN < head_dim < PAD_TO and head_dim % 2 == 0
        attn.npu_cos_sin, attn.npu_seq_lens, attn.npu_calls = cos_sin, seq_lens, 0
        attn._rotary_mul_qk, attn._vision_attention = rotary, attention
        count += 1
    return count


def _pad_rows(t: torch.Tensor, half: int, tail: int) -> torch.Tensor:
    """Rows of ``t`` ``[G * 2 * half, ...]`` as G heads of two halves: each half gets ``tail`` zero rows."""
    rest = t.shape[1:]
    grouped = t.reshape(-1, 2, half, *rest)
    pad = [0, 0] * len(rest) + [0, tail]
    return nn.functional.pad(grouped, pad).reshape(-1, *rest)


def _pad_cols(t: torch.Tensor, half: int, tail: int) -> torch.Tensor:
    """Columns of ``t`` ``[R, G * 2 * half]`` as G heads of two halves: each half gets ``tail`` zero columns."""
    grouped = t.reshape(t.shape[0], -1, half)
    return nn.functional.pad(grouped, (0, tail)).reshape(t.shape[0], -1)


def _is_npu(attn: Any) -> bool:
    return isinstance(attn, _NPUVisionAttention)


def _unquantised(linear: nn.Module) -> bool:
    return isinstance(getattr(linear, "quant_method", None), UnquantizedLinearMethod)


def pad_vision_heads(tower: nn.Module) -> int:
    """Pad the head dim of every marked attention of ``tower`` to :data:`PAD_TO` in its loaded weights (see the
    module doc); returns how many were padded. Once per attention: a padded one is skipped, so calling again is a
    no-op. Attentions split over tensor-parallel ranks, or with quantised linears, stay unpadded."""
    padded = 0
    for attn in _vision_attentions(tower):
        if not _is_npu(attn) or attn.npu_pad or not getattr(attn, "npu_wants_pad", False):
            continue
        if getattr(attn, "tp_size", 1) != 1 or not (_unquantised(attn.qkv) and _unquantised(attn.proj)):
            continue
        half = attn.npu_head_dim // 2
        tail = PAD_TO // 2 - half
        qkv, proj = attn.qkv, attn.proj
        # ``.data`` keeps vLLM's Parameter objects (and their loader attributes); only the storage grows.
        qkv.weight.data = _pad_rows(qkv.weight.data, half, tail)
        if getattr(qkv, "bias", None) is not None:
            qkv.bias.data = _pad_rows(qkv.bias.data, half, tail)
        proj.weight.data = _pad_cols(proj.weight.data, half, tail)
        attn.hidden_size_per_attention_head = PAD_TO  # what vLLM's split_qkv views the heads as
        attn.npu_head_dim, attn.npu_pad = PAD_TO, True
        padded += 1
    return padded
