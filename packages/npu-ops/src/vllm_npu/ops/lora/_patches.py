# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ops layer's declared patches (entry point ``vllm_npu.patches`` -> ``ops``), read only by npu-patches'
registry: importing this module needs npu-patches, and only that registry imports it."""

from __future__ import annotations

from vllm_npu.interface import Scope
from vllm_npu.patches import Patch

LORA_NPU_LAYERS = Patch(
    id="lora-npu-layers",
    target="vllm.lora.models.from_layer",
    replacement="vllm_npu.ops.lora.layers:from_layer_npu_first",
    scope=Scope.WORKER,
    vllm=">=0.11.0,<0.12",
    fingerprint="3f95a3a9ddb723a549333072fa9eb3726e4b61a42b341418beb08bf41009d3e9",
    # 0.11.1: from_layer only reformatted (its logic the same). Reviewed on 0.11.1/0.11.2.
    changes=(
        (
            "0.11.1",
            (("vllm.lora.models.from_layer", "200d4e45a9119a65ab6fc0faa0029d7dc1b52f0a3cc12218b3922251d0993edd"),),
        ),
    ),
    also_checks=(
        # the caller: it looks from_layer up as a global of vllm.lora.models when it builds the LoRA modules
        (
            "vllm.lora.models.LoRAModelManager._create_lora_modules",
            "e5909aa2ba769b5453a0b9a52de145c87986734c2c689c2a3ceb8c44d68a0d05",
        ),
    ),
    upstream="none filed yet: vLLM 0.11 has no registration API for LoRA layer classes (the set "
    "vllm.lora.utils._all_lora_classes is private and every can_replace_layer tests the exact base type). "
    "Fix to propose: a public register function, or can_replace_layer by isinstance with the most derived match",
    reason="vLLM's LoRA manager wraps a layer only when a LoRA class accepts its exact type; the ops layer replaces "
    "the token embedding (VocabParallelEmbedding) with its own subclass, so an adapter targeting embed_tokens gets no "
    "LoRA wrapper and the manager fails (assert isinstance(module, BaseLayerWithLoRA)) for every model whose LoRA "
    "modules include the embedding (Llama, Mixtral, ...). The replacement asks npu-ops' LoRA classes (vLLM's LoRA "
    "classes matched to our layer classes) first, then vLLM's",
    removal="drop when vLLM lets a plugin register LoRA layer classes (or matches subclasses); then register "
    "vllm_npu.ops.lora.NPU_LORA_CLASSES there",
    layer="ops",
)

PATCHES: tuple[Patch, ...] = (LORA_NPU_LAYERS,)
