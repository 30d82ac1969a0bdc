# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``PunicaWrapperNPU``: vLLM's multi-LoRA wrapper on the NPU kernels of :mod:`.kernels`.

vLLM's LoRA layers call the wrapper (``add_lora_linear``, ``add_shrink``/``add_expand`` for the fully sharded
layers, ``add_lora_embedding``, ``add_lora_logits``); the wrapper keeps the token -> slot mapping of the current
batch (:class:`PunicaWrapperBase` fills it from vLLM's ``LoRAMapping``) and picks the kernels: segmented ("sgmv")
when the mapping is a prefill mapping, which vLLM's V1 model runner always sets, batched gather ("bgmv") otherwise
and for the logits (one row per request). A batch in which no token uses a LoRA launches no kernel at all.

Eager only: the wrapper decides per batch in Python (whether any token uses a LoRA, how many segments), which a
captured graph would freeze, so it refuses to be traced (:func:`_eager_only`) instead of replaying the first batch's
decisions for every later one.

vLLM 0.11.1 dropped LoRA bias (``enable_lora_bias``): its layers call ``add_lora_linear`` and ``add_expand``
positionally without ``lora_bias_stacked``. ``PunicaWrapperNPU`` is the variant of the installed vLLM's wrapper API
(:func:`vllm_has_lora_bias` reads it off ``PunicaWrapperBase``): :class:`PunicaWrapperNPUWithBias` for 0.11.0,
:class:`PunicaWrapperNPUNoBias` from 0.11.1 on; both run the same kernels.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase

from .kernels import BGMV_EXPAND, BGMV_SHRINK, SGMV_EXPAND, SGMV_SHRINK

Tensors = tuple[torch.Tensor, ...] | torch.Tensor


def _eager_only() -> None:
    if torch.compiler.is_compiling():
        from vllm_npu.interface import ConfigError

        raise ConfigError(
            "LoRA on the NPU runs eagerly, but a LoRA layer is being compiled into a graph: start vLLM with "
            '--enforce-eager (or --additional-config \'{"npu": {"graph_mode": "eager"}}\')'
        )


def vllm_has_lora_bias() -> bool:
    """Whether the installed vLLM's wrapper API carries LoRA bias (0.11.0) or not (0.11.1 on)."""
    return "lora_bias_stacked" in inspect.signature(PunicaWrapperBase.add_lora_linear).parameters


class _PunicaWrapperNPUBase(PunicaWrapperBase):
    """Multi-LoRA shrink/expand for the NPU (and, with the reference kernels, the emulated device)."""

    def __init__(
        self, max_num_batched_tokens: int, max_batches: int, device: torch.device | str, **kwargs: Any
    ) -> None:
        super().__init__(max_num_batched_tokens, max_batches, device)
        from .layers import check_npu_lora_layers

        check_npu_lora_layers()
        self._sgmv_shrink = SGMV_SHRINK.select()
        self._sgmv_expand = SGMV_EXPAND.select()
        self._bgmv_shrink = BGMV_SHRINK.select()
        self._bgmv_expand = BGMV_EXPAND.select()
        self._any_lora = False

    def update_metadata(self, mapping: Any, lora_index_to_id: list[int | None], *args: Any, **kwargs: Any) -> None:
        super().update_metadata(mapping, lora_index_to_id, *args, **kwargs)
        # From the host-side mapping: no device read-back to decide that the batch needs no LoRA kernel.
        self._any_lora = any(i > 0 for i in mapping.index_mapping)

    # -- one slice ----------------------------------------------------------------------------------------------
    def _mapped_rows(self, num_tokens: int) -> int:
        """How many leading rows the batch's LoRA mapping covers; rows past them (padding) get no LoRA."""
        n = self.indices_len[0] or 0
        if num_tokens < n:
            raise ValueError(f"the LoRA layer got {num_tokens} tokens but the batch's LoRA mapping has {n}")
        return n

    def _shrink(self, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: float) -> None:
        n = self._mapped_rows(x.shape[0])
        if n < x.shape[0]:
            y[n:].zero_()
            x, y = x[:n], y[:n]
        if self.is_prefill:
            self._sgmv_shrink(x, w, y, self._seq_lengths[: self.batch_size], self._segment_loras, scale)
        else:
            self._bgmv_shrink(x, w, y, self.token_lora_indices, scale)

    def _expand(self, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offset: int, size: int, add: bool) -> None:
        n = self._mapped_rows(x.shape[0])
        x, y = x[:n], y[:n]
        if self.is_prefill:
            self._sgmv_expand(x, w, y, self._seq_lengths[: self.batch_size], self._segment_loras, offset, size, add)
        else:
            self._bgmv_expand(x, w, y, self.token_lora_indices, offset, size, add)

    @property
    def _segment_loras(self) -> torch.Tensor:
        return self._lora_indices_per_batch[: self.batch_size]

    # -- vLLM's wrapper API -------------------------------------------------------------------------------------
    def add_shrink(
        self, y: Tensors, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...], scale: float, **kwargs: Any
    ) -> None:
        """``y[i][t] = scale * x[t] @ A_i[lora(t)]^T`` for each slice ``i`` (``y[i]`` is ``[T, r]``)."""
        _eager_only()
        x = x.view(-1, x.shape[-1])
        for i, w in enumerate(lora_a_stacked):
            out = y[i]
            if self._any_lora:
                self._shrink(out.view(-1, out.shape[-1]), x, w, scale)
            else:
                out.zero_()

    def _expand_slices(
        self,
        y: torch.Tensor,
        x: Tensors,
        lora_b_stacked: tuple[torch.Tensor, ...],
        lora_bias_stacked: tuple[torch.Tensor, ...] | None,
        output_slices: tuple[int, ...],
        offset_start: int,
        add_inputs: bool,
    ) -> None:
        """``y[t, slice i] += x[i][t] @ B_i[lora(t)]^T (+ bias_i[lora(t)])``, the slices laid side by side from
        ``offset_start``."""
        _eager_only()
        if not self._any_lora:
            return
        y2 = y.view(-1, y.shape[-1])
        if lora_bias_stacked is not None:
            self._apply_bias(self.token_lora_indices, y2, output_slices, lora_bias_stacked)
        offset = offset_start
        for i, w in enumerate(lora_b_stacked):
            self._expand(y2, x[i], w, offset, output_slices[i], add_inputs)
            offset += output_slices[i]

    def add_lora_embedding(
        self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked: torch.Tensor, add_inputs: bool = True, **kwargs: Any
    ) -> None:
        """``y[t] += x[t] @ B[lora(t)]^T`` (the embedding LoRA's A is a row lookup done by the layer)."""
        _eager_only()
        if not self._any_lora:
            return
        self._expand(y, x, lora_b_stacked, 0, min(lora_b_stacked.shape[-2], y.shape[-1]), add_inputs)

    def _lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        lora_bias_stacked: tuple[torch.Tensor, ...] | None,
        scale: float,
        output_slices: tuple[int, ...],
        buffer: tuple[torch.Tensor, ...] | None,
    ) -> None:
        """``y[t, slice i] += scale * x[t] @ A_i[lora(t)]^T @ B_i[lora(t)]^T (+ bias)``, in place on ``y``."""
        _eager_only()
        if not len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices):
            raise ValueError(
                f"add_lora_linear: {len(lora_a_stacked)} A and {len(lora_b_stacked)} B stacks for "
                f"{len(output_slices)} output slices"
            )
        if not self._any_lora:
            return
        x = x.view(-1, x.shape[-1])
        if buffer is None:
            r = lora_b_stacked[0].size(-1)
            # float32 like vLLM's kernels: the rank-r intermediate keeps full precision
            buffer = tuple(torch.zeros((x.size(0), r), dtype=torch.float32, device=x.device) for _ in output_slices)
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self._expand_slices(y, buffer, lora_b_stacked, lora_bias_stacked, output_slices, 0, True)

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """``y[i] += scale * x[i] @ A[lora(i)]^T @ B[lora(i)]^T``, one row per request (the sampler mapping)."""
        _eager_only()
        if not self._any_lora:
            return
        y2 = y.view(-1, y.shape[-1])
        x = x.view(-1, x.shape[-1])
        indices = self.sampler_indices
        if buffer is None:
            buffer = torch.zeros((x.size(0), lora_b_stacked.size(-1)), dtype=torch.float32, device=x.device)
        self._bgmv_shrink(x, lora_a_stacked, buffer, indices, scale)
        self._bgmv_expand(buffer, lora_b_stacked, y2, indices, 0, min(lora_b_stacked.shape[-2], y2.shape[-1]), True)


class PunicaWrapperNPUWithBias(_PunicaWrapperNPUBase):
    """vLLM 0.11.0's wrapper API: ``add_expand`` and ``add_lora_linear`` take ``lora_bias_stacked``."""

    def add_expand(
        self,
        y: torch.Tensor,
        x: Tensors,
        lora_b_stacked: tuple[torch.Tensor, ...],
        lora_bias_stacked: tuple[torch.Tensor, ...] | None,
        output_slices: tuple[int, ...],
        offset_start: int = 0,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        """``y[t, slice i] += x[i][t] @ B_i[lora(t)]^T (+ bias_i[lora(t)])``, the slices laid side by side from
        ``offset_start``."""
        self._expand_slices(y, x, lora_b_stacked, lora_bias_stacked, output_slices, offset_start, add_inputs)

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        lora_bias_stacked: tuple[torch.Tensor, ...] | None,
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        """``y[t, slice i] += scale * x[t] @ A_i[lora(t)]^T @ B_i[lora(t)]^T (+ bias)``, in place on ``y``."""
        self._lora_linear(y, x, lora_a_stacked, lora_b_stacked, lora_bias_stacked, scale, output_slices, buffer)


class PunicaWrapperNPUNoBias(_PunicaWrapperNPUBase):
    """vLLM 0.11.1's wrapper API (LoRA bias removed). The type checker sees 0.11.0's base class, hence the ignores."""

    def add_expand(  # type: ignore[override]
        self,
        y: torch.Tensor,
        x: Tensors,
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        offset_start: int = 0,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        """``y[t, slice i] += x[i][t] @ B_i[lora(t)]^T``, the slices laid side by side from ``offset_start``."""
        self._expand_slices(y, x, lora_b_stacked, None, output_slices, offset_start, add_inputs)

    def add_lora_linear(  # type: ignore[override]
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        """``y[t, slice i] += scale * x[t] @ A_i[lora(t)]^T @ B_i[lora(t)]^T``, in place on ``y``."""
        self._lora_linear(y, x, lora_a_stacked, lora_b_stacked, None, scale, output_slices, buffer)


#: The wrapper vLLM's ``get_punica_wrapper`` names: the variant of the installed vLLM's API.
PunicaWrapperNPU: type[_PunicaWrapperNPUBase] = (
    PunicaWrapperNPUWithBias if vllm_has_lora_bias() else PunicaWrapperNPUNoBias
)
