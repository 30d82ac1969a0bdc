# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``multimodal-merge-index-put``: the multimodal embedding merge as a boolean-index write, not
``masked_scatter_``.

vLLM 0.11.0 (``vllm/model_executor/models/utils.py::_merge_multimodal_embeddings``) writes the encoder outputs into
the placeholder rows with ``inputs_embeds.masked_scatter_(is_multimodal.unsqueeze(-1), flattened)``: a ``[T, 1]``
mask broadcast over ``[T, H]``. torch_npu 2.8.0 has ``masked_scatter_`` (``npu_native_functions_by_codegen.yaml``),
so this is correct on an NPU, but the aclnn kernel's shape check rejects a mask whose shape differs from ``self``
and the op falls back to the AI CPU (vllm-ascend's record: commit a09d0a7a3f "mask shape [N,1] != self shape [N,D]
fails CheckShapeLimit", Qwen3-VL-Embedding-8B on an Atlas 910C 11.8 -> 23.7 it/s once the merge avoided it).
vllm-ascend v0.11.0 replaces the function with ``inputs_embeds[is_multimodal] = flattened``
(``vllm_ascend/patch/worker/patch_multimodal_merge.py``, since vllm-ascend PR #3071), an ``index_put_`` on the AI
vector cores; that is the call that has run on hardware, and the replacement here makes the same one.

Differences from vllm-ascend's replacement, both keeping vLLM 0.11.0's behaviour: the encoder output is cast to the
embeddings' dtype first (``index_put_`` refuses mixed dtypes, where ``masked_scatter_`` had vLLM's explicit cast),
and a count mismatch raises vLLM's own ``ValueError`` text. In vLLM 0.11.0 every model merges through
``merge_multimodal_embeddings``, which looks the function up in ``utils``' globals at call time, so rebinding the
module attribute reaches them all (no model module imports it by name; checked by grep).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """Build the ``index_put_`` merge (``original`` is kept by the registry)."""
    from vllm.model_executor.models.utils import _embedding_count_expression, _flatten_embeddings

    def _merge_multimodal_embeddings(inputs_embeds: Any, is_multimodal: Any, multimodal_embeddings: Any) -> Any:
        """Write ``multimodal_embeddings`` (flattened ``[M, H]``) into the rows of ``inputs_embeds`` ``[T, H]``
        where ``is_multimodal`` ``[T]`` (bool) is set, in place; returns ``inputs_embeds``. ``M`` must equal the
        number of set rows (else ``ValueError``)."""
        flattened = _flatten_embeddings(multimodal_embeddings)
        try:
            inputs_embeds[is_multimodal] = flattened.to(dtype=inputs_embeds.dtype)
        except RuntimeError as e:
            num_expected_tokens = int(is_multimodal.sum().item())
            if flattened.shape[0] != num_expected_tokens:
                expr = _embedding_count_expression(multimodal_embeddings)
                raise ValueError(
                    f"Attempted to assign {expr} = {flattened.shape[0]} "
                    f"multimodal tokens to {num_expected_tokens} placeholders"
                ) from e
            raise ValueError("Error during masked scatter operation") from e
        return inputs_embeds

    _merge_multimodal_embeddings.__module__ = original.__module__
    _merge_multimodal_embeddings.__wrapped__ = original  # type: ignore[attr-defined]
    return _merge_multimodal_embeddings
