# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vLLM's LoRA layer classes, matched to the ops layer's linear and embedding classes.

vLLM picks the LoRA wrapper of a layer in ``vllm.lora.utils.from_layer``, by asking each class of its private
``_all_lora_classes`` set ``can_replace_layer(source_layer, ...)``; every one of them tests the *exact* type
(``type(layer) is ColumnParallelLinear``), so none accepts :class:`~vllm_npu.ops.linear.NPUColumnParallelLinear`
and friends, which the ops layer installs in place of vLLM's classes. Each class here subclasses vLLM's LoRA class
(all of its weights, slicing, TP and forward are vLLM's) and only answers ``can_replace_layer`` for our class, with
vLLM's conditions (number of packed modules, ``fully_sharded_loras``).

vLLM offers no public way to add a LoRA class, so npu-ops declares one patch (:mod:`._patches`, id
``lora-npu-layers``) that wraps ``from_layer`` as the LoRA model manager sees it: our classes are asked first, then
vLLM's. :func:`from_layer_npu_first` is that wrapper; :func:`check_npu_lora_layers` (called when the Punica wrapper
is built, i.e. when a LoRA manager is created) turns a missing patch into a clear error instead of vLLM's bare
``assert isinstance(module, BaseLayerWithLoRA)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Optional

from torch import nn
from vllm.lora import layers as vl
from vllm.model_executor.layers.linear import MergedColumnParallelLinear

from .. import linear as npu_linear
from .. import vocab_parallel_embedding as npu_vocab

#: Attribute on the ``from_layer`` replacement that :func:`check_npu_lora_layers` looks for.
WRAPPER_FLAG = "__vllm_npu_lora_layers__"
PATCH_ID = "lora-npu-layers"


class _MatchNPULayer:
    """``can_replace_layer`` for the ops layer's classes. ``_accepts`` lists ``(class, packed module counts)``
    (``None`` = any count); ``_sharded`` is the ``fully_sharded_loras`` value required (``None`` = either)."""

    _accepts: ClassVar[tuple[tuple[type, Optional[tuple[int, ...]]], ...]] = ()
    _sharded: ClassVar[Optional[bool]] = False

    @classmethod
    def can_replace_layer(
        cls,
        source_layer: nn.Module,
        lora_config: Any,
        packed_modules_list: list,
        model_config: Any = None,
        **kwargs: Any,
    ) -> bool:
        if cls._sharded is not None and bool(lora_config.fully_sharded_loras) != cls._sharded:
            return False
        return any(
            type(source_layer) is base and (counts is None or len(packed_modules_list) in counts)
            for base, counts in cls._accepts
        )


class _MergedFlagFix:
    """vLLM's ColumnParallelLinearWithLoRA decides how to slice B at TP > 1 with ``type(base) is
    MergedColumnParallelLinear``; our merged class is a subclass, so the flag is recomputed with isinstance."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__(base_layer)  # type: ignore[call-arg]
        self.is_merged_col_linear = isinstance(base_layer, MergedColumnParallelLinear)


_COLUMN = (
    (npu_linear.NPUColumnParallelLinear, None),
    (npu_linear.NPUMergedColumnParallelLinear, (1,)),
)
_MERGED = ((npu_linear.NPUMergedColumnParallelLinear, (2,)),)
_QKV = ((npu_linear.NPUQKVParallelLinear, (1,)),)
_MERGED_QKV = ((npu_linear.NPUQKVParallelLinear, (3,)),)
_ROW = ((npu_linear.NPURowParallelLinear, None),)


class NPUColumnParallelLinearWithLoRA(_MatchNPULayer, _MergedFlagFix, vl.ColumnParallelLinearWithLoRA):
    _accepts = _COLUMN


class NPUMergedColumnParallelLinearWithLoRA(_MatchNPULayer, vl.MergedColumnParallelLinearWithLoRA):
    _accepts = _MERGED


class NPUQKVParallelLinearWithLoRA(_MatchNPULayer, vl.QKVParallelLinearWithLoRA):
    _accepts = _QKV


class NPUMergedQKVParallelLinearWithLoRA(_MatchNPULayer, vl.MergedQKVParallelLinearWithLoRA):
    _accepts = _MERGED_QKV


class NPURowParallelLinearWithLoRA(_MatchNPULayer, vl.RowParallelLinearWithLoRA):
    _accepts = _ROW


class NPUReplicatedLinearWithLoRA(_MatchNPULayer, vl.ReplicatedLinearWithLoRA):
    _accepts = ((npu_linear.NPUReplicatedLinear, None),)
    _sharded = None  # vLLM's replicated LoRA layer serves both settings


class NPUVocabParallelEmbeddingWithLoRA(_MatchNPULayer, vl.VocabParallelEmbeddingWithLoRA):
    _accepts = ((npu_vocab.NPUVocabParallelEmbedding, None),)
    _sharded = None


class NPUColumnParallelLinearWithShardedLoRA(_MatchNPULayer, _MergedFlagFix, vl.ColumnParallelLinearWithShardedLoRA):
    _accepts = _COLUMN
    _sharded = True


class NPUMergedColumnParallelLinearWithShardedLoRA(_MatchNPULayer, vl.MergedColumnParallelLinearWithShardedLoRA):
    _accepts = _MERGED
    _sharded = True


class NPUQKVParallelLinearWithShardedLoRA(_MatchNPULayer, vl.QKVParallelLinearWithShardedLoRA):
    _accepts = _QKV
    _sharded = True


class NPUMergedQKVParallelLinearWithShardedLoRA(_MatchNPULayer, vl.MergedQKVParallelLinearWithShardedLoRA):
    _accepts = _MERGED_QKV
    _sharded = True


class NPURowParallelLinearWithShardedLoRA(_MatchNPULayer, vl.RowParallelLinearWithShardedLoRA):
    _accepts = _ROW
    _sharded = True


#: Asked in this order, before vLLM's own classes. (The LM head needs none: vLLM wraps the logits processor with
#: ``LogitsProcessorWithLoRA`` without a type test, and that works over ``NPULogitsProcessor``.)
NPU_LORA_CLASSES: tuple[type[vl.BaseLayerWithLoRA], ...] = (
    NPUVocabParallelEmbeddingWithLoRA,
    NPUColumnParallelLinearWithLoRA,
    NPUMergedColumnParallelLinearWithLoRA,
    NPUQKVParallelLinearWithLoRA,
    NPUMergedQKVParallelLinearWithLoRA,
    NPURowParallelLinearWithLoRA,
    NPUReplicatedLinearWithLoRA,
    NPUColumnParallelLinearWithShardedLoRA,
    NPUMergedColumnParallelLinearWithShardedLoRA,
    NPUQKVParallelLinearWithShardedLoRA,
    NPUMergedQKVParallelLinearWithShardedLoRA,
    NPURowParallelLinearWithShardedLoRA,
)


def npu_lora_class(
    layer: nn.Module, lora_config: Any, packed_modules_list: list, model_config: Any = None
) -> Optional[type[vl.BaseLayerWithLoRA]]:
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
