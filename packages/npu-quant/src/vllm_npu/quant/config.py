# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``AscendQuantConfig``: vLLM's quantization config for msModelSlim checkpoints, registered as ``ascend``.

How a checkpoint gets here:

- ``--quantization ascend`` (vLLM's option has no argparse choices; it validates against the registered methods);
  vLLM then reads ``quant_model_description.json`` through :meth:`get_config_filenames`;
- automatically, ONLY when the checkpoint carries a msModelSlim description: either ``config.json``'s
  ``quantization_config`` is one (old msModelSlim, or ``{"quant_method": "ascend"}`` written by our quantizer) —
  :meth:`override_quantization_method` — or ``quant_model_description.json`` sits next to ``config.json`` —
  :func:`vllm_npu.quant.detect.claim_checkpoint`, called by the platform. FP8, AWQ, GPTQ, compressed-tensors
  checkpoints are never claimed.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm_npu.interface import get_logger, is_msmodelslim_quant_config

from .description import (
    DESCRIPTION_FILENAME,
    LINEAR_SCHEMES,
    MOE_SCHEMES,
    QuantDescription,
    QuantDescriptionError,
    find_description_file,
    looks_like_description,
)
from .detect import QUANT_METHOD

logger = get_logger(__name__)


class AscendQuantConfig(QuantizationConfig):
    """The parsed description plus the layer dispatch. ``description`` is None until the file is read (when
    ``config.json`` only says ``{"quant_method": "ascend"}``, :meth:`maybe_update_config` reads the file)."""

    def __init__(self, description: QuantDescription | None) -> None:
        super().__init__()
        self.description = description
        self._mapper: Any = None
        # prefix -> linear layer built so far (C8: an attention layer finds its K/V projections, built before it)
        self._linears: dict[str, torch.nn.Module] = {}

    # --- vLLM's class-level contract --------------------------------------------------------------------------------
    # vLLM types method names as the Literal of its built-in methods (QuantizationMethods), which an out-of-tree
    # method registered through register_quantization_config cannot be part of.
    @classmethod
    def get_name(cls) -> str:  # type: ignore[override]
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        # float32 serves the emulated device (tiny test models); NPUs run fp16/bf16.
        return [torch.int8, torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # not a CUDA method; the NPU platform reports no CUDA capability

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [DESCRIPTION_FILENAME]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AscendQuantConfig:
        if looks_like_description(config):
            return cls(QuantDescription.from_mapping(config, source="config.json quantization_config"))
        # {"quant_method": "ascend", ...}: the description is a file beside config.json (read in maybe_update_config).
        return cls(None)

    @classmethod
    def override_quantization_method(  # type: ignore[override]  # the same Literal, see get_name
        cls, hf_quant_cfg: Any, user_quant: str | None
    ) -> str | None:
        if user_quant not in (None, QUANT_METHOD):
            return None
        if is_msmodelslim_quant_config(hf_quant_cfg):
            return QUANT_METHOD
        return None

    def maybe_update_config(self, model_name: str) -> None:
        if self.description is not None:
            return
        path = find_description_file(model_name)
        if path is None:
            raise QuantDescriptionError(
                f"quantization 'ascend' needs {DESCRIPTION_FILENAME} in the model directory {model_name!r}, and it is "
                "not there; point vLLM at a msModelSlim (or `vllm-npu quantize`) output directory"
            )
        self.description = QuantDescription.from_file(path)
        self._check_unsupported()

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        self._mapper = hf_to_vllm_mapper
        if self.description is not None:
            self._map_description()

    def _map_description(self) -> None:
        if self._mapper is None or self.description is None:
            return
        mapped = self._mapper.apply_dict(dict(self.description.tensors))
        for key, value in mapped.items():
            self.description.tensors.setdefault(key, value)

    def _check_unsupported(self) -> None:
        desc = self._desc
        if desc.fa_quant_type:
            raise QuantDescriptionError(
                f"{desc.source}: fa_quant_type={desc.fa_quant_type!r} (quantized attention, FA3) is not implemented "
                "by npu-quant; re-export without attention quantization (an int8 KV cache, C8, is served)"
            )

    @property
    def _desc(self) -> QuantDescription:
        if self.description is None:
            raise QuantDescriptionError(
                f"the 'ascend' quant config has no description yet: {DESCRIPTION_FILENAME} was not read"
            )
        return self.description

    # --- dispatch --------------------------------------------------------------------------------------------------
    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import FusedMoE
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        desc = self._desc
        if self._mapper is not None:
            self._map_description()
            self._mapper = None
        self._check_unsupported()
        if isinstance(layer, LinearBase):
            if desc.kv_c8:  # until the attention layer of its block takes it (_c8_method)
                self._linears[prefix] = layer
            return self._linear_method(prefix)
        if isinstance(layer, FusedMoE):
            qtype = desc.experts_type(prefix)
            if qtype == "FLOAT":
                from vllm.model_executor.layers.fused_moe.layer import UnquantizedFusedMoEMethod

                return UnquantizedFusedMoEMethod(layer.moe_config)
            if qtype not in MOE_SCHEMES:
                raise QuantDescriptionError(
                    f"FusedMoE layer {prefix!r} is {qtype!r} in {desc.source}; npu-quant implements MoE experts for "
                    f"{', '.join(MOE_SCHEMES)} only"
                )
            from .moe_method import (
                AscendW4A8DynamicFusedMoEMethod,
                AscendW8A8DynamicFusedMoEMethod,
                AscendW8A8FusedMoEMethod,
            )

            if qtype == "W8A8":
                return AscendW8A8FusedMoEMethod(layer.moe_config, prefix)
            if qtype == "W4A8_DYNAMIC":
                return AscendW4A8DynamicFusedMoEMethod(layer.moe_config, prefix, desc.group_size, desc.version)
            return AscendW8A8DynamicFusedMoEMethod(layer.moe_config, prefix)
        if isinstance(layer, VocabParallelEmbedding):
            # Embeddings and lm_head stay in floating point; a description that quantizes them is rejected rather
            # than silently loaded as floats. A missing entry is fine (msModelSlim often omits lm_head, #8367).
            try:
                _, qtype = desc.lookup_tensor(prefix, [f"{prefix}.weight"])
            except QuantDescriptionError:
                return None
            if qtype != "FLOAT":
                raise QuantDescriptionError(
                    f"{prefix!r} is {qtype!r} in {desc.source}; quantized embeddings / lm_head are not supported"
                )
            return None
        from vllm.attention.layer import Attention

        if isinstance(layer, Attention) and desc.kv_c8:
            return self._c8_method(layer, prefix)
        return None

    def _linear_method(self, prefix: str) -> QuantizeMethodBase:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        desc = self._desc
        qtype = desc.linear_type(prefix, self.packed_modules_mapping)
        if qtype == "FLOAT":
            return UnquantizedLinearMethod()
        if qtype not in LINEAR_SCHEMES:
            raise QuantDescriptionError(
                f"layer {prefix!r} is {qtype!r} in {desc.source}; linear layers support {', '.join(LINEAR_SCHEMES)}"
            )
        from .linear_method import AscendLinearMethod
        from .schemes import make_linear_scheme

        return AscendLinearMethod(make_linear_scheme(qtype, desc), prefix)

    def _c8_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase:
        """The int8 KV cache of attention layer ``prefix``: refused by name for layers C8 cannot serve, and for a
        description that lists C8 scales but none for this layer (checked here, before any weight is loaded)."""
        from .kv_c8 import AscendC8KVCacheMethod, c8_projections, check_c8_layer

        desc = self._desc
        check_c8_layer(layer, prefix, desc.source)
        if desc.kv_scale_keys():
            block = prefix.rpartition(".")[0]
            for kv, proj in (("key", "k_proj"), ("value", "v_proj")):
                desc.lookup_tensor(prefix, [f"{prefix}.{kv}_antiquant_scale", f"{block}.{proj}.kv_cache_scale"])
        projections = c8_projections(self._linears, prefix)
        block = prefix.rpartition(".")[0]
        for name in [k for k in self._linears if k.rpartition(".")[0] == block]:
            del self._linears[name]  # the block's linears are built: hold no module past its attention layer
        return AscendC8KVCacheMethod(self, prefix, projections)

    def get_scaled_act_names(self) -> list[str]:
        return []


def register() -> None:
    """Register ``ascend`` with vLLM's quantization registry (guarded: vLLM raises on a second registration)."""
    from vllm_npu.interface import once

    def _do() -> None:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

        if QUANT_METHOD in QUANTIZATION_METHODS:
            # Another plugin (vllm-ascend) owns the name in this process: never fight over it.
            logger.warning(
                "quantization method %r is already registered by another plugin; npu-quant leaves it", QUANT_METHOD
            )
            return
        register_quantization_config(QUANT_METHOD)(AscendQuantConfig)

    once("npu-quant:register_quantization_config:ascend", _do)
