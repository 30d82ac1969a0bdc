# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``attention-output-empty``: no zero-fill of the attention output buffer on every forward.

vLLM 0.11.0's ``Attention.forward`` allocates the output of every attention layer with ``torch.zeros`` (vllm#19784
changed ``empty`` to ``zeros`` because some backends return early on the profiling run and leave the buffer
unwritten). On an NPU the zero-fill is one extra kernel launch per layer per step, and inside a captured ACL graph
it cannot be removed (an allocation can). vllm#26680 returns to ``torch.empty`` upstream.

``empty`` is only safe when the backend writes every element of the buffer. So the patched forward uses ``empty``
only for layers whose ``impl`` declares ``fills_output_buffer = True``: npu-interface's
:class:`~vllm_npu.interface.protocols.OutputBufferFiller` (``impl.forward`` writes every element of ``output`` on
every call, including the profile run with ``attn_metadata is None`` and padded token rows). The contract lives in
the interface because npu-attention declares it and this patch reads it, and neither wheel depends on the other. It
calls vLLM's original forward, zero-fill included, for every other layer and for the paths it does not own
(``calculate_kv_scales``, fp8 ``query_quant``, ``use_output=False``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm_npu.interface import fills_output_buffer


def new_output(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The output buffer of a declaring impl: allocated, not initialised (tests poison it to prove the contract)."""
    return torch.empty(shape, dtype=dtype, device=device)


def make_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """Build the ``Attention.forward`` that allocates its output with ``torch.empty`` for backends that fill it."""
    from vllm.forward_context import get_forward_context

    def forward(
        self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output_shape: torch.Size | None = None
    ) -> torch.Tensor:
        if (
            not self.use_output
            or self.calculate_kv_scales
            or self.query_quant is not None
            or not fills_output_buffer(self.impl)
        ):
            return original(self, query, key, value, output_shape)
        shape = output_shape if output_shape is not None else query.shape
        # The backend overwrites every element (its declared contract), so no fill is needed.
        output = new_output(shape, query.dtype, query.device)
        hidden_size = shape[-1]
        if not self.use_mla:  # MLA passes latent q/k/v whose shapes are the backend's business
            query = query.view(-1, self.num_heads, self.head_size)
            output = output.view(-1, self.num_heads, self.head_size)
            if key is not None:
                key = key.view(-1, self.num_kv_heads, self.head_size)
            if value is not None:
                value = value.view(-1, self.num_kv_heads, self.head_size)
        if self.use_direct_call:
            context = get_forward_context()
            metadata = context.attn_metadata
            if isinstance(metadata, dict):
                metadata = metadata[self.layer_name]
            self.impl.forward(self, query, key, value, self.kv_cache[context.virtual_engine], metadata, output=output)
        else:
            torch.ops.vllm.unified_attention_with_output(query, key, value, output, self.layer_name)
        return output.view(-1, hidden_size)

    forward.__module__ = original.__module__
    forward.__qualname__ = original.__qualname__
    forward.__doc__ = original.__doc__
    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward
