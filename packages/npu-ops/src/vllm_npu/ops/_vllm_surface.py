# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM internals the ops layer overrides or reads, with the vLLM 0.11.0 signatures. Checked by
``tests/test_vllm_surface.py`` and ``vllm-npu doctor --vllm-surface``; see :mod:`vllm_npu.interface.vllm_surface`."""

from __future__ import annotations

from vllm_npu.interface import REMOVED, VllmName

SURFACE: tuple[VllmName, ...] = (
    VllmName(
        "vllm.model_executor.custom_op:CustomOp",
        "_forward_method",
        "instance_attribute",
        "writes",
        ("vllm_npu.ops.layernorm",),
        "NPURMSNorm routes the variants the NPU kernel lacks (variance override, no weight) to forward_native by "
        "replacing the method CustomOp.forward dispatches to; if CustomOp stops reading it, those variants run the "
        "NPU kernel with the wrong arguments",
    ),
    VllmName(
        "vllm.model_executor.layers.logits_processor:LogitsProcessor",
        "_get_logits",
        "method",
        "calls",
        ("vllm_npu.ops.vocab_parallel_embedding",),
        "NPULogitsProcessor.forward computes the (gathered) logits through it",
        signature="(self, hidden_states, lm_head, embedding_bias)",
    ),
    VllmName(
        "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding",
        "_match_cos_sin_cache_dtype",
        "method",
        "calls",
        ("vllm_npu.ops.mrope", "vllm_npu.ops.rotary_embedding"),
        "the NPU rotary embeddings move vLLM's cos/sin cache to the query's device and dtype through it",
        signature="(self, query)",
    ),
    VllmName(
        "vllm.forward_context",
        "_forward_context",
        "module_global",
        "reads",
        ("vllm_npu.ops.rotary_embedding", "vllm_npu.ops.moe.capture"),
        "the per-forward cos/sin cache is keyed on the current ForwardContext, and the MoE dispatchers read its "
        "cudagraph_runtime_mode (graph step or not); both read the global directly because get_forward_context() "
        "asserts outside a forward",
    ),
    VllmName(
        "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase",
        "_apply_bias",
        "method",
        "calls",
        ("vllm_npu.ops.lora.punica",),
        "PunicaWrapperNPU.add_expand adds the LoRA bias (enable_lora_bias) through vLLM's own helper; vLLM 0.11.1 "
        "removed LoRA bias with it, and PunicaWrapperNPUNoBias never calls it",
        signature="(self, indices, output, output_slices, lora_bias_stacked)",
        changes=(("0.11.1", REMOVED),),
    ),
    VllmName(
        "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase",
        "_seq_lengths",
        "instance_attribute",
        "reads",
        ("vllm_npu.ops.lora.punica",),
        "the prefill kernels take the batch's segment lengths that PunicaWrapperBase.update_metadata fills",
    ),
    VllmName(
        "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase",
        "_lora_indices_per_batch",
        "instance_attribute",
        "reads",
        ("vllm_npu.ops.lora.punica",),
        "the prefill kernels take the LoRA slot of each segment that PunicaWrapperBase.update_metadata fills",
    ),
    VllmName(
        "vllm.lora.worker_manager:WorkerLoRAManager",
        "_load_adapter",
        "method",
        "overrides",
        ("vllm_npu.ops.lora.manager",),
        "NPUWorkerLoRAManager checks an adapter's tensor shapes right after vLLM's loader reads it, before the "
        "adapter takes a cache entry or a slot; without the override a mismatched adapter fails in an anonymous "
        "tensor copy or is silently applied to a corner of the layer",
        signature="(self, lora_request)",
    ),
    VllmName(
        "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager",
        "_adapter_manager",
        "instance_attribute",
        "reads",
        ("vllm_npu.ops.lora.manager",),
        "the shape check reads the LoRA-wrapped modules (modules, packed_modules) of vLLM's LoRA model manager",
    ),
)
