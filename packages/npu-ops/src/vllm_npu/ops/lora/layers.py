# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vLLM's LoRA layer classes, matched to the ops layer's layer classes.

vLLM picks the LoRA wrapper of a layer in ``vllm.lora.utils.from_layer``, by asking each class of its private
``_all_lora_classes`` set ``can_replace_layer(source_layer, ...)``; every one of them tests the *exact* type
(``type(layer) is VocabParallelEmbedding``). The ops layer installs its own subclass for the token embedding
(:class:`~vllm_npu.ops.vocab_parallel_embedding.NPUVocabParallelEmbedding`), which no vLLM LoRA class accepts; the
linear layers are vLLM's own classes (no override), so vLLM's LoRA classes wrap them as they are. Each class here
subclasses vLLM's LoRA class (weights, slicing, TP and forward are vLLM's) and only answers ``can_replace_layer``
for our class, with vLLM's conditions. The LM head needs none: vLLM leaves ``ParallelLMHead`` itself unwrapped and
wraps the logits processor with ``LogitsProcessorWithLoRA`` without a type test, which works over
``NPULogitsProcessor``.

vLLM offers no public way to add a LoRA class, so npu-ops declares one patch (:mod:`._patches`, id
``lora-npu-layers``) that wraps ``from_layer`` as the LoRA model manager sees it: our classes are asked first, then
vLLM's. :func:`from_layer_npu_first` is that wrapper; :func:`check_npu_lora_layers` (called when the Punica wrapper
is built, i.e. when a LoRA manager is created) turns a missing patch into a clear error instead of vLLM's bare
``assert isinstance(module, BaseLayerWithLoRA)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from vllm.lora import layers as vl

from .. import vocab_parallel_embedding as npu_vocab

#: Attribute on the ``from_layer`` replacement that :func:`check_npu_lora_layers` looks for.
WRAPPER_FLAG = "__vllm_npu_lora_layers__"
PATCH_ID = "lora-npu-layers"


class NPUVocabParallelEmbeddingWithLoRA(vl.VocabParallelEmbeddingWithLoRA):
    """vLLM's embedding LoRA layer over :class:`~vllm_npu.ops.vocab_parallel_embedding.NPUVocabParallelEmbedding`
    (its forward calls the base layer's, i.e. our masked lookup; both ``fully_sharded_loras`` settings, as vLLM's)."""

    @classmethod
    def can_replace_layer(
        cls,
        source_layer: nn.Module,
        lora_config: Any,
        packed_modules_list: list,
        model_config: Any = None,
        **kwargs: Any,
    ) -> bool:
        return type(source_layer) is npu_vocab.NPUVocabParallelEmbedding


#: Asked in this order, before vLLM's own classes.
NPU_LORA_CLASSES: tuple[type[vl.BaseLayerWithLoRA], ...] = (NPUVocabParallelEmbeddingWithLoRA,)


def npu_lora_class(
    layer: nn.Module, lora_config: Any, packed_modules_list: list, model_config: Any = None
) -> type[vl.BaseLayerWithLoRA] | None:
    """The class of :data:`NPU_LORA_CLASSES` that wraps ``layer``, or None (not one of our layer classes)."""
    for cls in NPU_LORA_CLASSES:
        if cls.can_replace_layer(
            source_layer=layer,
            lora_config=lora_config,
            packed_modules_list=packed_modules_list,
            model_config=model_config,
        ):
            return cls
    return None


def from_layer_npu_first(original: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Factory of the ``lora-npu-layers`` patch: ``from_layer`` that wraps our layer classes with
    :data:`NPU_LORA_CLASSES` and leaves every other layer to vLLM's ``original``."""

    def from_layer(
        layer: nn.Module,
        max_loras: int,
        lora_config: Any,
        packed_modules_list: list,
        model_config: Any = None,
    ) -> nn.Module:
        """``layer`` wrapped by its LoRA class (``create_lora_weights`` done), or ``layer`` if none fits."""
        cls = npu_lora_class(layer, lora_config, packed_modules_list, model_config)
        if cls is None:
            return original(layer, max_loras, lora_config, packed_modules_list, model_config)
        wrapped = cls(layer)
        wrapped.create_lora_weights(max_loras, lora_config, model_config)
        return wrapped

    from_layer.__module__ = original.__module__
    from_layer.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(from_layer, WRAPPER_FLAG, True)
    return from_layer


def check_npu_lora_layers() -> None:
    """Raise, naming the fix, when vLLM's LoRA manager would not wrap our layer classes (the patch is absent)."""
    from vllm.lora import models

    if not getattr(models.from_layer, WRAPPER_FLAG, False):
        from vllm_npu.interface import ConfigError

        raise ConfigError(
            "LoRA on the NPU needs the npu-patches patch "
            f"{PATCH_ID!r} (it lets vLLM's LoRA manager wrap the ops layer's linear and embedding classes), and it "
            'is not applied in this process: install the patches layer (pip install "npu-platform[patches]") and '
            f"do not disable {PATCH_ID!r} in VLLM_NPU_PATCHES or npu.disabled_patches"
        )
