# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM internals (and signature-sensitive hooks) the platform layer overrides or calls, with the vLLM 0.11.0
signatures. Checked by ``tests/test_vllm_surface.py`` and ``vllm-npu doctor --vllm-surface``; see
:mod:`vllm_npu.interface.vllm_surface`."""

from __future__ import annotations

from vllm_npu.interface import REMOVED, VllmName

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_PLATFORM = "vllm.platforms.interface:Platform"
_KV_MIXIN = "vllm.v1.worker.kv_connector_model_runner_mixin:KVConnectorModelRunnerMixin"
_MODEL_RUNNER = ("vllm_npu.platform.model_runner",)
_WORKER_MODULE = ("vllm_npu.platform.worker",)
_PLATFORM_MODULE = ("vllm_npu.platform.platform",)

SURFACE: tuple[VllmName, ...] = (
    VllmName(
        _KV_MIXIN,
        "kv_connector_no_forward",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "the runner's step without a forward: ours keeps the connectors' stats that vLLM 0.11.0 drops there "
        "(vllm_npu.platform.kv_no_forward); a renamed seam would bring the loss back",
        signature="(scheduler_output, vllm_config)",
    ),
    VllmName(
        _KV_MIXIN,
        "_get_kv_connector_output",
        "method",
        "calls",
        ("vllm_npu.platform.kv_no_forward",),
        "the no-forward step runs the connectors' per-step work (start loads, finished transfers, stats) through it",
        signature="(scheduler_output, wait_for_save=True)",
    ),
    VllmName(
        "vllm.v1.outputs:KVConnectorOutput",
        "is_empty",
        "method",
        "calls",
        ("vllm_npu.platform.kv_no_forward",),
        "decides whether the no-forward step reports anything; it counts the stats on every release of the line",
        signature="(self)",
    ),
    VllmName(
        _RUNNER,
        "_update_hybrid_attention_mamba_layout",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "vLLM re-strides a hybrid model's attention caches into the pages they share with the state layers; the NPU "
        "cache kernels need each attention layer's K and V contiguous",
        signature="(self, kv_caches)",
    ),
    VllmName(
        _RUNNER,
        "_kv_cache_spec_attn_group_iterator",
        "method",
        "calls",
        _MODEL_RUNNER,
        "the hybrid layout override walks the attention groups through it",
        signature="(self)",
    ),
    VllmName(
        _RUNNER,
        "_attn_group_iterator",
        "method",
        "calls",
        _MODEL_RUNNER,
        "after vLLM downgrades the graph mode, the builders of every attention group are told (they read the mode "
        "at construction)",
        signature="(self)",
    ),
    VllmName(
        _RUNNER,
        "_sync_device",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "without the override vLLM calls torch.cuda.synchronize() between steps",
        signature="(self)",
    ),
    VllmName(
        _RUNNER,
        "_make_buffer",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "on the emulated (CPU) device vLLM's CpuGpuBuffer aliases its host and device halves; EAGLE/MTP drafting "
        "increments both halves of seq_lens, i.e. one tensor twice",
        signature="(self, *size, dtype, numpy=True)",
    ),
    VllmName(
        _RUNNER,
        "_init_device_properties",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "without the override vLLM reads torch.cuda.get_device_properties() in __init__",
        signature="(self)",
    ),
    VllmName(
        _RUNNER,
        "_allocate_kv_cache_tensors",
        "method",
        "calls",
        _MODEL_RUNNER,
        "initialize_kv_cache_tensors allocates the KV caches of models whose cache layers share a layer index "
        "(DeepSeek-V3.2) through it",
        signature="(self, kv_cache_config)",
    ),
    VllmName(
        _RUNNER,
        "_reshape_kv_cache_tensors",
        "method",
        "calls",
        _MODEL_RUNNER,
        "initialize_kv_cache_tensors shapes those KV caches through it",
        signature="(self, kv_cache_config, kv_cache_raw_tensors)",
        changes=(("0.11.1", "(self, kv_cache_config, kv_cache_raw_tensors, kernel_block_sizes)"),),
    ),
    VllmName(
        _RUNNER,
        "initialize_kv_cache_tensors",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "the override binds DeepSeek-V3.2's MLA and indexer caches, which vLLM's bind_kv_cache rejects off CUDA",
        signature="(self, kv_cache_config)",
        changes=(("0.11.1", "(self, kv_cache_config, kernel_block_sizes)"),),
    ),
    VllmName(
        _RUNNER,
        "execute_model",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "the override passes its arguments through inside the device's stream API",
        signature="(self, scheduler_output, intermediate_tensors=None)",
    ),
    VllmName(
        "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput",
        "_model_runner_output",
        "instance_attribute",
        "reads",
        _MODEL_RUNNER,
        "under async scheduling the step's output is this wrapper; the failed requests are reported on the "
        "ModelRunnerOutput it hands the scheduler",
    ),
    VllmName(
        _RUNNER,
        "_sample",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "the override applies the structured-output bitmask (every logits dtype) and guards per-request logits "
        "processors before vLLM's sampling step",
        signature="(self, logits, spec_decode_metadata)",
    ),
    VllmName(
        _RUNNER,
        "load_lora_model",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "the override builds npu-ops' worker LoRA manager (it checks adapter tensor shapes) where vLLM's mixin builds "
        "its LRU manager; a change of vLLM's body (checks, arguments) must be mirrored",
        signature="(self, model, vllm_config, device)",
    ),
    VllmName(
        _RUNNER,
        "shared_kv_cache_layers",
        "instance_attribute",
        "reads",
        _MODEL_RUNNER,
        "initialize_kv_cache_tensors maps KV-sharing layers to their target's cache through it",
    ),
    VllmName(
        _WORKER,
        "_maybe_get_memory_pool_context",
        "method",
        "overrides",
        _WORKER_MODULE,
        "without the override vLLM's load_model loads the weights inside CuMemAllocator's pool when sleep mode is on",
        signature="(self, tag)",
    ),
    VllmName(
        _WORKER,
        "initialize_from_config",
        "method",
        "overrides",
        _WORKER_MODULE,
        "the override allocates the KV cache through our model runner; from 0.11.1 vLLM's also makes the worker's KV "
        "connector there (worker.KV_CONNECTOR_AT_KV_CACHE_INIT): without it a decode instance never pulls its KV and "
        "its requests wait forever",
        signature="(self, kv_cache_config)",
    ),
    VllmName(
        "vllm.distributed.kv_transfer",
        "ensure_kv_transfer_initialized",
        "module_global",
        "calls",
        _WORKER_MODULE,
        "NPUWorker.initialize_from_config makes the worker's KV connector with it on vLLM 0.11.1 (its kv_cache_config "
        "parameter tells the release)",
    ),
    VllmName(
        _WORKER,
        "determine_available_memory",
        "method",
        "overrides",
        _WORKER_MODULE,
        "the override sizes the KV cache from the NPU allocator or the emulated budget",
        signature="(self)",
    ),
    VllmName(
        _WORKER,
        "sleep",
        "method",
        "overrides",
        _WORKER_MODULE,
        "the override releases device memory without CuMemAllocator",
        signature="(self, level=1)",
    ),
    VllmName(
        _WORKER,
        "wake_up",
        "method",
        "overrides",
        _WORKER_MODULE,
        "the override regrows what sleep released",
        signature="(self, tags=None)",
    ),
    VllmName(
        "vllm.config.compilation:CompilationConfig",
        "_attention_ops",
        "attribute",
        "reads",
        ("vllm_npu.platform.graphs.config",),
        "piecewise graph mode splits the model at these attention ops; without them Dynamo would trace attention "
        "into a graph piece",
    ),
    VllmName(
        "vllm.config.scheduler:SchedulerConfig",
        "cuda_graph_sizes",
        "instance_attribute",
        "reads",
        ("vllm_npu.platform.graphs.config",),
        "vllm_default_sizes recognises vLLM's default capture list by it on 0.11.0 (0.11.1 dropped it and derives the "
        "list from max_num_seqs); read wrongly, the emulated default compiles vLLM's dozens of sizes (issue 35)",
        changes=(("0.11.1", REMOVED),),
    ),
    VllmName(
        "vllm.config.compilation:CompilationConfig",
        "init_with_cudagraph_sizes",
        "method",
        "calls",
        ("vllm_npu.platform.graphs.config",),
        "set_capture_sizes derives vLLM 0.11.0's max_capture_size and padded sizes from the resolved list through it",
        signature="(self, cudagraph_capture_sizes)",
        changes=(("0.11.1", REMOVED),),
    ),
    VllmName(
        "vllm.config.compilation:CompilationConfig",
        "post_init_cudagraph_sizes",
        "method",
        "calls",
        ("vllm_npu.platform.graphs.config",),
        "set_capture_sizes derives vLLM 0.11.1's compile sizes and padded sizes from the resolved list through it",
        signature="(self)",
        since="0.11.1",
    ),
    VllmName(
        _PLATFORM,
        "get_attn_backend_cls",
        "method",
        "overrides",
        _PLATFORM_MODULE,
        "vLLM calls the override with these arguments to pick the attention backend (from 0.11.1 vLLM still calls "
        "an override that has use_v1 the old way, plus attn_type as a tenth argument, which ours accepts)",
        signature="(selected_backend, head_size, dtype, kv_cache_dtype, block_size, use_v1, use_mla, has_sink, "
        "use_sparse)",
        changes=(
            (
                "0.11.1",
                "(selected_backend, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse, "
                "attn_type=None)",
            ),
        ),
    ),
    VllmName(
        _PLATFORM,
        "get_vit_attn_backend",
        "method",
        "overrides",
        _PLATFORM_MODULE,
        "vLLM's vision towers ask it (through vision.get_vit_attn_backend) which ViT attention kernel to build",
        signature="(head_size, dtype)",
    ),
    VllmName(
        _PLATFORM,
        "check_and_update_config",
        "method",
        "overrides",
        _PLATFORM_MODULE,
        "vLLM calls the override with the VllmConfig it builds",
        signature="(vllm_config)",
    ),
    VllmName(
        _PLATFORM,
        "stateless_init_device_torch_dist_pg",
        "method",
        "overrides",
        _PLATFORM_MODULE,
        "vLLM's stateless_init_torch_distributed_process_group calls the override for every non-gloo backend (RL "
        "weight sync with backend='hccl')",
        signature="(backend, prefix_store, group_rank, group_size, timeout)",
    ),
    VllmName(
        _PLATFORM,
        "get_device_total_memory",
        "method",
        "overrides",
        _PLATFORM_MODULE,
        "vLLM calls it in the front-end process; the override raises NotImplementedError (which vLLM catches) so the "
        "front-end never initialises the NPU runtime",
        signature="(device_id=0)",
    ),
    VllmName(
        _WORKER,
        "profile",
        "method",
        "overrides",
        _WORKER_MODULE,
        "vLLM's collective_rpc('profile') (LLM.start_profile / stop_profile) calls the override, which starts or "
        "stops the NPU / CPU profiler that replaces vLLM's CUDA one",
        signature="(self, is_start=True)",
    ),
    VllmName(
        _PLATFORM,
        "pre_register_and_update",
        "method",
        "overrides",
        _PLATFORM_MODULE,
        "vLLM calls the override before it builds the ModelConfig; without the quant layer it registers the gate "
        "that refuses msModelSlim checkpoints with the install command",
        signature="(parser=None)",
    ),
    VllmName(
        "vllm.model_executor.layers.quantization.base_config:QuantizationConfig",
        "maybe_update_config",
        "method",
        "overrides",
        ("vllm_npu.platform._quant_gate",),
        "VllmConfig calls it with the model path right after building the quant config; the gate raises the "
        "missing-layer error there, the first call that names the checkpoint",
        signature="(self, model_name)",
    ),
    VllmName(
        _RUNNER,
        "_capture_cudagraphs",
        "method",
        "calls",
        _MODEL_RUNNER,
        "capture_model captures the graphs of each runtime mode through it (warm-up and capture per size)",
        signature="(self, compilation_cases, cudagraph_runtime_mode, uniform_decode)",
        # Same parameters on 0.11.1, but compilation_cases holds (num_tokens, activate_lora) pairs there (the
        # capture passes them as such: model_runner.CAPTURE_CASES_WITH_LORA).
    ),
    VllmName(
        _RUNNER,
        "_preprocess",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "the override zeroes the positions of a step's graph padding (0.11.0: the first two results are the "
        "scheduled and padded token counts; 0.11.1: the padded count is the argument, model_runner."
        "PREPROCESS_TAKES_NUM_INPUT); without it RoBERTa's in-place position offset grows the stale padding slots every step "
        "until the position embedding raises IndexError (vllm#37868)",
        signature="(self, scheduler_output, intermediate_tensors=None, ubatch_slices=None, "
        "num_tokens_after_padding=None)",
        changes=(("0.11.1", "(self, scheduler_output, num_input_tokens, intermediate_tensors=None)"),),
    ),
    VllmName(
        _RUNNER,
        "get_dp_padding",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "0.11.0: the _dummy_run override takes the DP counts through it and our override hands them back to vLLM's "
        "_dummy_run (one exchange per run) to run the dummy batch at the padded count; a change would add a "
        "collective or lose the pad",
        signature="(self, num_tokens)",
        changes=(("0.11.1", REMOVED),),
    ),
    VllmName(
        _RUNNER,
        "_dummy_run",
        "method",
        "calls",
        _MODEL_RUNNER,
        "estimate_graph_memory measures one eager forward at the largest capture size through it",
        signature="(self, num_tokens, cudagraph_runtime_mode=None, force_attention=False, uniform_decode=False, "
        "allow_microbatching=True, skip_eplb=False, is_profile=False, create_mixed_batch=False, remove_lora=True)",
        changes=(
            (
                "0.11.1",
                "(self, num_tokens, cudagraph_runtime_mode=None, force_attention=False, uniform_decode=False, "
                "allow_microbatching=True, skip_eplb=False, is_profile=False, create_mixed_batch=False, "
                "remove_lora=True, activate_lora=False)",
            ),
        ),
    ),
    VllmName(
        _RUNNER,
        "_dummy_sampler_run",
        "method",
        "calls",
        _MODEL_RUNNER,
        "the emulated profile_run samples once from its (smaller) dummy forward, as vLLM's profile_run does",
        signature="(self, hidden_states)",
    ),
    VllmName(
        _RUNNER,
        "_dummy_pooler_run",
        "method",
        "calls",
        _MODEL_RUNNER,
        "the emulated profile_run pools once from its dummy forward for pooling models, as vLLM's profile_run does",
        signature="(self, hidden_states)",
    ),
    VllmName(
        _PLATFORM,
        "_enum",
        "attribute",
        "overrides",
        _PLATFORM_MODULE,
        "vLLM's is_out_of_tree() / is_cuda() and friends read it: PlatformEnum.OOT keeps every CUDA-only branch off",
    ),
    VllmName(
        _RUNNER,
        "initialize_cudagraph_capture",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "vLLM 0.11.0 resolves the graph mode against the backends' graph support there; the torchair mode keeps its "
        "mode (SFA's support is NEVER). 0.11.1 moved that into _check_and_update_cudagraph_mode",
        signature="(self)",
        changes=(("0.11.1", REMOVED),),
    ),
    VllmName(
        _RUNNER,
        "_check_and_update_cudagraph_mode",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "vLLM 0.11.1 resolves the graph mode there, when it builds the attention backends; the torchair mode keeps "
        "its mode",
        signature="(self, attention_backends, kv_cache_groups)",
        since="0.11.1",
    ),
    VllmName(
        _RUNNER,
        "sample_tokens",
        "method",
        "overrides",
        _MODEL_RUNNER,
        "vLLM 0.11.1 samples there (split out of execute_model); the override applies the grammar bitmask in _sample "
        "and reports per-request faults on its output",
        signature="(self, grammar_output)",
        since="0.11.1",
    ),
    VllmName(
        _RUNNER,
        "execute_model_state",
        "instance_attribute",
        "reads",
        _MODEL_RUNNER,
        "sample_tokens reads the step's scheduler output (its scheduled draft tokens) from it, for the bitmask rows",
        since="0.11.1",
    ),
    VllmName(
        "vllm.v1.sample.rejection_sampler:RejectionSampler",
        "_get_logprobs_tensors",
        "method",
        "calls",
        ("vllm_npu.platform.sample.rejection_sampler",),
        "vLLM 0.11.1's rejection sampler returns the accepted tokens' logprobs; NPURejectionSamplerWithSampler "
        "computes them through it",
        signature="(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids)",
        since="0.11.1",
    ),
)
