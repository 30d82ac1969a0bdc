# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ops layer's CustomOp override table and its idempotent registration with vLLM.

``OOT_OPS`` maps the name of a vLLM CustomOp class (``CustomOp.register_oot`` keys on the exact class name, so
subclasses with other names keep vLLM's class) to the ``"module:Class"`` that replaces it. Nothing is imported
until :func:`register_oot_ops` runs (from the ops layer's hooks). Every registration goes through
``registry.once`` because vLLM asserts on duplicate names.
"""

from __future__ import annotations

import importlib

from vllm_npu.interface.log import get_logger
from vllm_npu.interface.registry import once

logger = get_logger(__name__)

OOT_OPS: dict[str, str] = {
    # norms
    "RMSNorm": "vllm_npu.ops.layernorm:NPURMSNorm",
    "GemmaRMSNorm": "vllm_npu.ops.layernorm:NPUGemmaRMSNorm",
    # activations
    "SiluAndMul": "vllm_npu.ops.activation:NPUSiluAndMul",
    "QuickGELU": "vllm_npu.ops.activation:NPUQuickGELU",
    # rotary embeddings
    "RotaryEmbedding": "vllm_npu.ops.rotary_embedding:NPURotaryEmbedding",
    "DeepseekScalingRotaryEmbedding": "vllm_npu.ops.rotary_embedding:NPUDeepseekScalingRotaryEmbedding",
    "YaRNScalingRotaryEmbedding": "vllm_npu.ops.rotary_embedding:NPUYaRNScalingRotaryEmbedding",
    "MRotaryEmbedding": "vllm_npu.ops.mrope:NPUMRotaryEmbedding",
    # linear layers
    "ReplicatedLinear": "vllm_npu.ops.linear:NPUReplicatedLinear",
    "ColumnParallelLinear": "vllm_npu.ops.linear:NPUColumnParallelLinear",
    "MergedColumnParallelLinear": "vllm_npu.ops.linear:NPUMergedColumnParallelLinear",
    "QKVParallelLinear": "vllm_npu.ops.linear:NPUQKVParallelLinear",
    "RowParallelLinear": "vllm_npu.ops.linear:NPURowParallelLinear",
    # embedding, LM head, logits
    "VocabParallelEmbedding": "vllm_npu.ops.vocab_parallel_embedding:NPUVocabParallelEmbedding",
    "ParallelLMHead": "vllm_npu.ops.vocab_parallel_embedding:NPUParallelLMHead",
    "LogitsProcessor": "vllm_npu.ops.vocab_parallel_embedding:NPULogitsProcessor",
    # MoE (vllm_npu.ops.moe, optional)
    "FusedMoE": "vllm_npu.ops.moe.layer:AscendFusedMoE",
    "SharedFusedMoE": "vllm_npu.ops.moe.layer:AscendSharedFusedMoE",
}

# Rows whose module may legitimately be absent: skipped (with a debug line) instead of failing registration.
OPTIONAL_MODULES: tuple[str, ...] = ("vllm_npu.ops.moe",)


def resolve(target: str) -> type:
    """Import ``"module:Class"``."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _is_optional_missing(target: str, exc: ImportError) -> bool:
    """True when ``target``'s own module (or a parent package) is absent and it is optional. A module that exists
    but fails to import (a bug, a missing dependency) is not skipped."""
    module = target.partition(":")[0]
    missing = getattr(exc, "name", None) or ""
    if not missing or not (module == missing or module.startswith(missing + ".")):
        return False
    return any(module == m or module.startswith(m + ".") for m in OPTIONAL_MODULES)


def register_oot_ops(table: dict[str, str] | None = None) -> list[str]:
    """Register every override of ``table`` (default :data:`OOT_OPS`) with ``CustomOp.register_oot``, once per
    process. Returns the vLLM class names registered by this call (already-registered ones are not repeated)."""
    from vllm.model_executor.custom_op import CustomOp

    done = []
    for name, target in (OOT_OPS if table is None else table).items():
        try:
            cls = resolve(target)
        except ImportError as exc:
            if _is_optional_missing(target, exc):
                logger.debug("optional override %s -> %s not installed: %s", name, target, exc)
                continue
            raise

        def _register(cls: type = cls, name: str = name, target: str = target) -> None:
            existing = CustomOp.op_registry_oot.get(name)
            if existing is not None and existing is not cls:
                raise RuntimeError(
                    f"vLLM CustomOp {name!r} is already overridden by {existing.__module__}.{existing.__qualname__}; "
                    f"vllm_npu.ops wants {target}. Two out-of-tree plugins override the same op: uninstall one"
                )
            if existing is None:
                CustomOp.register_oot(_decorated_op_cls=cls, name=name)

        if once(f"vllm_npu.ops.register_oot:{name}", _register):
            done.append(name)
    if done:
        logger.debug("registered CustomOp overrides: %s", ", ".join(done))
    return done
