# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Rotary embedding overrides: ``npu_rotary_mul`` with cos/sin gathered once per forward.

Kernel contract (torch_npu 2.8.0 docs), ``npu_rotary_mul(x, r1, r2, rotary_mode) -> y``:

- ``x [1, T, N, R]`` (BSND), ``r1``/``r2`` = cos/sin ``[1, T, 1, R]`` (full rotary width), fp16/bf16/fp32;
- ``half`` (GPT-NeoX): ``x1, x2 = chunk(x, 2, -1)``; ``y = r1 * x + r2 * cat(-x2, x1)``;
- ``interleave`` (GPT-J): ``y = r1 * x + r2 * stack(-x[..., 1::2], x[..., ::2]).flatten(-2)``.

cos/sin for the current forward are gathered from the layer's ``cos_sin_cache`` once, on the first layer that sees
a given positions tensor, and every later layer of the same forward reuses them (:class:`PerForwardCosSin`). vLLM's
``get_rope`` shares one rotary module between all layers of a model, so the cache lives on the module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm import forward_context as _vllm_forward_context
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import YaRNScalingRotaryEmbedding
from vllm_npu.interface import Kernel

# Bound once: Dynamo recognises the function object itself (it traces as a constant True), and eager calls skip
# two attribute lookups. The Dynamo-only variant is one Python call where ``is_compiling`` is two; Dynamo is the
# only tracer that reaches this code (vLLM's piecewise graph mode).
_is_compiling = torch.compiler.is_dynamo_compiling

# --- kernel ---------------------------------------------------------------------------------------------------


def rotary_mul_npu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_rotary_mul(x, cos, sin, rotary_mode=mode)


def rotary_mul_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    xf = x.float()
    if mode == "half":
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-xf[..., 1::2], xf[..., ::2]), dim=-1).flatten(-2)
    return (xf * cos.float() + rotated * sin.float()).to(x.dtype)


ROTARY_MUL = Kernel("rotary_mul", npu=rotary_mul_npu, reference=rotary_mul_reference)


# ``rotary_mul_qk(q, k, cos, sin, mode) -> (q', k')``: ``rotary_mul`` of ``q [1, T, N, R]`` and ``k [1, T, Nkv, R]``
# with the same cos/sin ``[1, T, 1, R]``. On the NPU two kernel calls. The reference rotates both in one pass over
# ``[1, T, N + Nkv, R]`` (element-wise maths: the same bits as two ``rotary_mul_reference`` calls): when k directly
# follows q in memory (q/k are adjacent column slices of the fused qkv projection's output) that is a view of both,
# otherwise a concatenation. q'/k' are views into one new tensor.


def rotary_mul_qk_npu(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    return torch_npu.npu_rotary_mul(q, cos, sin, rotary_mode=mode), torch_npu.npu_rotary_mul(
        k, cos, sin, rotary_mode=mode
    )


def _qk_view(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``[1, T, N + Nkv, R]`` viewing q's and k's storage, or None when k does not directly follow q there."""
    if _is_compiling() or q.dtype != k.dtype or q.stride() != k.stride() or q.stride(-1) != 1:
        return None
    n, r = q.shape[2], q.shape[3]
    if q.stride(2) != r or k.data_ptr() != q.data_ptr() + n * r * q.element_size():
        return None
    return q.as_strided((1, q.shape[1], n + k.shape[2], r), q.stride())


def rotary_mul_qk_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    qk = _qk_view(q, k)
    if qk is None:
        qk = torch.cat((q, k), dim=2)
    out = rotary_mul_reference(qk, cos, sin, mode)
    n = q.shape[2]
    return out[:, :, :n], out[:, :, n:]


ROTARY_MUL_QK = Kernel("rotary_mul_qk", npu=rotary_mul_qk_npu, reference=rotary_mul_qk_reference)


# --- cos/sin once per forward ---------------------------------------------------------------------------------


class PerForwardCosSin:
    """Holds the cos/sin of the last positions tensor seen; ``compute(positions, like) -> (cos, sin)`` gathers them
    on a miss. ``get`` returns ``(cos, sin, T)``: the token count rides along because reading it back from a shape
    costs a tuple allocation per layer.

    A hit needs the *same* positions tensor object, with the same version counter (no in-place write since), inside
    the same vLLM forward context. Identity alone would be unsafe when a caller rewrites one buffer in place, so when
    neither a version counter nor a forward context is available nothing is cached.
    """

    __slots__ = ("_compute", "_positions", "_version", "_ctx", "_value", "computed")

    def __init__(self, compute: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        self._compute = compute
        self._positions: torch.Tensor | None = None
        self._version: int | None = None
        self._ctx: Any = None
        self._value: Any = None
        self.computed = 0  # how many times cos/sin were gathered (for tests and benchmarks)

    def get(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(cos [1, T, 1, R], sin [1, T, 1, R], T)`` for ``positions`` (``like`` gives device and dtype).

        While torch.compile traces (vLLM's piecewise graph mode) the cache steps aside and every call computes: the
        hit check reads ``positions._version``, which Dynamo cannot trace, and a traced graph must not depend on
        Python-side state anyway. The repeated gathers are then plain graph ops (cheap, and deduplicated by the
        compiler where it can).

        The hit path is kept short on purpose: it runs once per layer per forward, between kernels that evict the
        interpreter's working set, so each bytecode there costs more than a micro-benchmark of it suggests."""
        if _is_compiling():
            cos, sin = self._compute(positions, like)
            return cos, sin, cos.shape[1]
        ctx = _vllm_forward_context._forward_context
        try:
            ver: int | None = positions._version
        except RuntimeError:  # inference tensors do not track versions
            ver = None
        if (
            positions is self._positions
            and ver == self._version
            and ctx is self._ctx
            and (ver is not None or ctx is not None)
        ):
            return self._value
        cos, sin = self._compute(positions, like)
        value = (cos, sin, cos.shape[1])
        self._positions, self._version, self._ctx, self._value = positions, ver, ctx, value
        self.computed += 1
        return value


def full_width(cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin halves ``[..., R/2]`` -> new contiguous full-width ``[..., R]`` tensors in the kernel's order (halves
    repeated for NeoX, interleaved for GPT-J). The one place that layout rule is written."""
    if is_neox:
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


RotateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def build_partial_rotate(kernel: Callable[..., torch.Tensor], mode: str, head_size: int, rotary_dim: int) -> RotateFn:
    """``rotate(x, cos, sin)`` for partial rotary (``rotary_dim < head_size``), ``x [T, N*D]`` or ``[T, N, D]`` and
    cos/sin ``[1, T, 1, rotary_dim]``: the kernel on the first ``rotary_dim`` channels of every head, the rest passed
    through; returns a new tensor of ``x``'s shape. Built once per layer, with the constants bound in the closure."""

    def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x4 = x.reshape(1, cos.shape[1], -1, head_size)
        rot = kernel(x4[..., :rotary_dim].contiguous(), cos, sin, mode)
        return torch.cat((rot, x4[..., rotary_dim:]), dim=-1).view_as(x)

    return rotate_partial


def expand_cos_sin(cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, R/2]`` halves -> full-width ``[1, T, 1, R]`` (:func:`full_width`)."""
    cos, sin = full_width(cos, sin, is_neox)
    t = cos.shape[0]
    return cos.view(1, t, 1, -1), sin.view(1, t, 1, -1)


class _NPURopeMixin:
    """The shared forward of the rotary overrides (``self`` is a vLLM RotaryEmbedding). Its ``forward_oot`` is the
    layer's forward itself (first in the MRO), not a method a subclass calls: one Python frame less per layer per
    step."""

    head_size: int
    rotary_dim: int
    is_neox_style: bool
    cos_sin_cache: torch.Tensor

    def _init_npu_rope(self) -> None:
        if self.rotary_dim % 2 or self.rotary_dim > self.head_size:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= head_size={self.head_size}")
        self._mode = "half" if self.is_neox_style else "interleave"
        self._bind_rotary_kernel(ROTARY_MUL.select(), ROTARY_MUL_QK.select())
        self._cos_sin = PerForwardCosSin(self._compute_cos_sin)  # bound once: the subclass's override, if any
        self._tables_src: torch.Tensor | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def _bind_rotary_kernel(
        self, kernel: Callable[..., torch.Tensor], kernel_qk: Callable[..., Any] | None = None
    ) -> None:
        """Bind the ``rotary_mul`` kernel (and ``rotary_mul_qk``, by default two ``kernel`` calls) everywhere the
        forward reads them (benchmarks rebind a counting wrapper)."""
        self._rotary_mul = kernel
        if kernel_qk is None:

            def kernel_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> Any:
                return kernel(q, cos, sin, mode), kernel(k, cos, sin, mode)

        full = self.rotary_dim == self.head_size
        # Full rotary's constants in one attribute (None for partial rotary): each attribute read of an nn.Module
        # is a visible cost on the per-layer path.
        self._full_rotary: tuple[Callable[..., torch.Tensor], Callable[..., Any], str, int] | None = (
            (kernel, kernel_qk, self._mode, self.head_size) if full else None
        )
        self._rotate_partial: RotateFn | None = (
            None if full else build_partial_rotate(kernel, self._mode, self.head_size, self.rotary_dim)
        )

    def _compute_cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._match_cos_sin_cache_dtype(like)  # type: ignore[attr-defined]
        if _is_compiling():
            # No layer state is written inside a traced graph: gather the halves and expand them in the graph.
            cos, sin = self.cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
            return expand_cos_sin(cos, sin, self.is_neox_style)
        if self._tables_src is not self.cos_sin_cache:  # first use, or the cache moved to another device/dtype
            # Full-width [P, R] tables, so a forward gathers each of cos and sin with one index_select.
            cos_half, sin_half = self.cos_sin_cache.chunk(2, dim=-1)
            self._tables = full_width(cos_half, sin_half, self.is_neox_style)
            self._tables_src = self.cos_sin_cache
        flat = positions.flatten()
        t = flat.shape[0]
        cos_t, sin_t = self._tables
        return cos_t.index_select(0, flat).view(1, t, 1, -1), sin_t.index_select(0, flat).view(1, t, 1, -1)

    def forward_oot(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``positions [T]`` (any shape with T elements), ``query [T, N*D]`` or ``[T, N, D]``, ``key`` likewise or
        None; returns new tensors of the input shapes.

        Full rotary (``rotary_dim == head_size``, the common case) is written out here rather than behind a helper:
        this runs once per layer per decode step, and two helper calls were a measurable share of a decode-size call
        (benchmarks/ops_dispatch_overhead.py)."""
        cos, sin, t = self._cos_sin.get(positions, query)
        full = self._full_rotary
        if full is not None:
            # [T, N*D] or [T, N, D] -> [1, T, N, D] only prepends a 1 and splits the last dimension, which a view
            # can always express, whatever the strides (q/k are column slices of the fused qkv output).
            mul, mul_qk, mode, d = full
            if key is None:
                return mul(query.view(1, t, -1, d), cos, sin, mode).view_as(query), None
            q, k = mul_qk(query.view(1, t, -1, d), key.view(1, t, -1, d), cos, sin, mode)
            return q.view_as(query), k.view_as(key)
        rotate = self._rotate_partial
        assert rotate is not None
        return rotate(query, cos, sin), (None if key is None else rotate(key, cos, sin))

    # For the subclasses whose own forward_oot adds arguments (offsets) and then rotates.
    _rope_forward = forward_oot


class NPURotaryEmbedding(_NPURopeMixin, RotaryEmbedding):
    """vLLM's RotaryEmbedding (NeoX or GPT-J style, partial ``rotary_dim``). ``positions [T]`` (any shape with T
    elements), ``query [T, N*D]`` or ``[T, N, D]``, ``key`` likewise or None; returns new tensors of the input shapes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_npu_rope()


class NPUYaRNScalingRotaryEmbedding(_NPURopeMixin, YaRNScalingRotaryEmbedding):
    """YaRN scaling: the scaled, mscale-weighted cos/sin live in ``cos_sin_cache``; the rotation is the base one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_npu_rope()


class NPUDeepseekScalingRotaryEmbedding(_NPURopeMixin, DeepseekScalingRotaryEmbedding):
    """DeepSeek's YaRN variant (usually GPT-J style). ``offsets`` (batched RoPE) shift the positions; the shifted
    positions are a new tensor, so they are gathered for that call only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_npu_rope()

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if key is None:
            raise ValueError("DeepseekScalingRotaryEmbedding needs a key tensor (vLLM's contract)")
        if offsets is not None:
            positions = positions + offsets
        return self._rope_forward(positions, query, key)
