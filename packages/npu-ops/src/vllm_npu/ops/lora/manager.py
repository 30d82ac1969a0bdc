# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The worker's LoRA manager: vLLM's LRU manager plus a check of every adapter's tensor shapes against the model.

vLLM 0.11 checks an adapter's rank (``max_lora_rank``) and target-module names when it loads it, but not its
tensor shapes: ``set_lora`` copies each ``lora_a`` / ``lora_b`` into the slot's zero-padded buffer slice
``[:rows, :cols]``, so a factor *larger* than the layer fails deep in the copy (``The size of tensor a (64) must
match the size of tensor b (128) at non-singleton dimension 1``, naming neither the adapter nor the tensor) and a
factor *smaller* than the layer is copied into a corner of the buffer: a silent wrong answer (on CUDA as here: the
LoRA layers are vLLM's, platform-independent). The copy also runs after the adapter has taken a slot, so a failure
there leaves a half-written slot that the adapter's next request would use.

:class:`NPUWorkerLoRAManager` runs :func:`check_adapter_shapes` right after vLLM's loader has read the checkpoint,
before the adapter is registered or activated: a mismatch is a ``ValueError`` naming the adapter, the tensor, the
shape it has and the shape the base model needs, and the engine keeps its state (other requests keep being served;
``/v1/load_lora_adapter`` answers 400 with that message).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
from vllm.model_executor.layers import linear as vlinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding


@dataclass(frozen=True)
class ExpectedShape:
    """Full (unsharded) sizes one adapted module's LoRA factors must have: ``lora_a`` ``[r, in_features]``,
    ``lora_b`` ``[out_features, r]``. ``out_features`` None: not checked (the LM head, whose ``lora_b`` vLLM pads
    to the vocabulary when it loads it)."""

    in_features: int
    out_features: int | None


def _linear_out_sizes(layer: Any) -> list[int]:
    """Full output size of each packed slice of a vLLM linear (one entry for an unpacked linear)."""
    if isinstance(layer, vlinear.QKVParallelLinear):
        # output_sizes counts replicated KV heads once per rank (tp > kv heads); the checkpoint has each head once
        kv = layer.total_num_kv_heads
        return [
            layer.total_num_heads * layer.head_size,
            kv * layer.head_size,
            kv * getattr(layer, "v_head_size", layer.head_size),
        ]
    if isinstance(layer, vlinear.MergedColumnParallelLinear):
        return list(layer.output_sizes)
    return [layer.output_size]


def expected_shapes(
    modules: Mapping[str, Any], packed_modules: Mapping[str, Sequence[str]], extra_vocab: int = 0
) -> dict[str, ExpectedShape]:
    """``{module name as in an adapter: ExpectedShape}`` for the LoRA-wrapped ``modules`` of vLLM's LoRA model
    manager (``manager.modules``; ``packed_modules`` maps a fused module, e.g. ``...qkv_proj``, to the names its
    slices have in a checkpoint, ``...q_proj`` / ``k_proj`` / ``v_proj``). Layers of other kinds are left out (not
    checked). ``extra_vocab``: the adapter's added tokens (its ``new_embeddings`` rows)."""
    shapes: dict[str, ExpectedShape] = {}
    for name, module in modules.items():
        base = getattr(module, "base_layer", None)
        if isinstance(base, vlinear.LinearBase):
            outs = _linear_out_sizes(base)
            shapes[name] = ExpectedShape(base.input_size, sum(outs))
            slices = packed_modules.get(name, ())
            if len(slices) == len(outs) > 1:
                for slice_name, out in zip(slices, outs, strict=True):
                    shapes[slice_name] = ExpectedShape(base.input_size, out)
        elif isinstance(base, VocabParallelEmbedding):  # lora_a [r, vocab], lora_b [hidden, r]
            shapes[name] = ExpectedShape(base.org_vocab_size + extra_vocab, base.embedding_dim)
        elif hasattr(module, "hidden_size") and hasattr(module, "sharded_to_full_mapping"):  # the LM head
            shapes[name] = ExpectedShape(module.hidden_size, None)
    return shapes


def check_adapter_shapes(
    adapter: str, loras: Mapping[str, Any], expected: Mapping[str, ExpectedShape], max_rank: int
) -> None:
    """Raise ``ValueError`` naming ``adapter`` and the tensor when a module's ``lora_a`` / ``lora_b`` (vLLM's
    ``LoRALayerWeights``, before packing) does not fit the base model: not 2-D, a rank that differs between the two
    factors or exceeds ``max_rank``, or in/out features other than the layer's. Modules not in ``expected`` are not
    checked (vLLM's loader has already refused names that are not LoRA targets)."""
    for module, weights in loras.items():
        want = expected.get(module)
        if want is None:
            continue
        a, b = weights.lora_a, weights.lora_b
        problem = None
        if a is None or b is None:
            problem = f"has only {'lora_b' if a is None else 'lora_a'} (both factors are needed)"
        elif a.dim() != 2 or b.dim() != 2:
            problem = f"has lora_a {list(a.shape)} and lora_b {list(b.shape)}; both must be 2-D"
        elif a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            problem = (
                f"has lora_a {list(a.shape)} and lora_b {list(b.shape)}: rank {a.shape[0]} vs {b.shape[1]} "
                f"(the two must agree and not exceed max_lora_rank {max_rank})"
            )
        elif a.shape[1] != want.in_features:
            problem = f"lora_a is {list(a.shape)}, the base model needs [{a.shape[0]}, {want.in_features}]"
        elif want.out_features is not None and b.shape[0] != want.out_features:
            problem = f"lora_b is {list(b.shape)}, the base model needs [{want.out_features}, {b.shape[1]}]"
        if problem is not None:
            raise ValueError(
                f"LoRA adapter {adapter!r} does not match the base model: {module} {problem}; the adapter was "
                "trained for another model (or another revision of it): use an adapter of this base model"
            )


class NPUWorkerLoRAManager(LRUCacheWorkerLoRAManager):
    """vLLM's LRU worker LoRA manager that refuses an adapter whose tensors do not fit the model (see the module
    docstring) before it takes a cache entry or a slot."""

    def _load_adapter(self, lora_request: Any) -> Any:
        lora = super()._load_adapter(lora_request)
        if self.lora_config is None:  # vLLM builds a worker LoRA manager only with a LoRA config
            raise RuntimeError("NPUWorkerLoRAManager needs vLLM's lora_config (start vLLM with --enable-lora)")
        manager = self._adapter_manager
        expected = expected_shapes(manager.modules, manager.packed_modules, lora.extra_vocab_size)
        check_adapter_shapes(lora_request.lora_name, lora.loras, expected, self.lora_config.max_lora_rank)
        return lora
