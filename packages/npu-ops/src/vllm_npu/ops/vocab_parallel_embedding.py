# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Token embedding, LM head and logits: vLLM's classes with an eager masked lookup and an NPU GEMM method.

- ``NPUVocabParallelEmbedding``: with TP > 1 each rank owns a slice of the vocabulary (plus added-vocab slots);
  ids outside the slice are looked up as row 0 and zeroed, then the ranks all-reduce. vLLM does the masking in a
  ``torch.compile``d helper; here it is eager (:func:`masked_vocab_input`) so the NPU does not go through the
  compiler for a handful of integer ops.
- ``NPUParallelLMHead``: the LM head's unquantized method computes logits with ``F.linear`` on the (ND) weight;
  the weight stays ND because it is often tied to the embedding table, which row lookups need in ND.
- ``NPULogitsProcessor``: vLLM's processor; soft-cap and scale are applied out of place so a logits view owned by
  the caller is never written.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)


def masked_vocab_input(
    ids: torch.Tensor, org_start: int, org_end: int, num_org_padding: int, added_start: int, added_end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global token ids -> (local row ids, mask of ids this rank does not own). Same contract as vLLM's
    ``get_masked_input_and_mask``: rows ``[0, org_end - org_start)`` hold the original vocab slice, the added
    vocab follows after ``num_org_padding`` padding rows; unowned ids map to row 0."""
    in_org = (ids >= org_start) & (ids < org_end)
    in_added = (ids >= added_start) & (ids < added_end)
    added_offset = added_start - (org_end - org_start) - num_org_padding
    owned = in_org | in_added
    local = torch.where(in_org, ids - org_start, ids - added_offset)
    return torch.where(owned, local, torch.zeros_like(ids)), ~owned


class NPUUnquantizedEmbeddingMethod(UnquantizedEmbeddingMethod):
    """Embedding rows by index; logits by ``F.linear`` (no CPU-platform GEMM dispatch)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)  # the parameter create_weights registered
        return torch.nn.functional.linear(x, weight, bias)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)
        return torch.nn.functional.embedding(input_, weight)


def _use_npu_method(layer: Any) -> None:
    if type(layer.quant_method) is UnquantizedEmbeddingMethod:
        layer.quant_method = NPUUnquantizedEmbeddingMethod()


class NPUVocabParallelEmbedding(VocabParallelEmbedding):
    """``ids [T] -> [T, H]``; with TP > 1 the masked local lookup and an all-reduce."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _use_npu_method(self)

    def forward_oot(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_.long())
        s = self.shard_indices
        local, unowned = masked_vocab_input(
            input_,
            s.org_vocab_start_index,
            s.org_vocab_end_index,
            s.num_org_vocab_padding,
            s.added_vocab_start_index,
            s.added_vocab_end_index,
        )
        out = self.quant_method.embedding(self, local.long())
        out.masked_fill_(unowned.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class NPUParallelLMHead(ParallelLMHead):
    """The LM head (its weight is used by the logits processor; calling it directly is an error, as in vLLM)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _use_npu_method(self)


class NPULogitsProcessor(LogitsProcessor):
    """``hidden [T, H] -> logits [T, vocab]`` through the LM head's method, gathered over TP, then soft-cap/scale."""

    def forward(
        self,
        lm_head: VocabParallelEmbedding,
        hidden_states: torch.Tensor,
        embedding_bias: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        logits = hidden_states if self.logits_as_input else self._get_logits(hidden_states, lm_head, embedding_bias)
        if logits is None:
            return None
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits
