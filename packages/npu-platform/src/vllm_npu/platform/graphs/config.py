# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The graph mode of an engine, from vLLM's own knobs and the plugin's ``npu.graph_mode``.

vLLM's knobs mean on the NPU what they mean on CUDA: ``--enforce-eager``, ``compilation_config.cudagraph_mode``,
``cudagraph_capture_sizes`` (or ``--cuda-graph-sizes``; vLLM 0.11.0 derives ``max_capture_size`` from them, 0.11.1
``max_cudagraph_capture_size``, which may be set instead of the list there).

================== ===========================================================================================
cudagraph_mode     on the NPU platform
================== ===========================================================================================
NONE               eager (no Dynamo, no graphs)
PIECEWISE          Dynamo splits the model at every attention op; each piece is captured per batch size and
                   replayed (ACL graphs / the emulated twin); attention runs eagerly between the pieces
FULL_DECODE_ONLY   pure-decode batches run as one captured graph of the whole model per batch size, with the
                   decode attention kernels' sequence lengths refreshed before every replay; other batches eager
FULL_AND_PIECEWISE downgraded to PIECEWISE, with the reason logged: it is also vLLM's default when nothing is set,
                   and full graphs are only supported for pure-decode batches (FULL_DECODE_ONLY)
FULL               refused: it would capture mixed prefill/decode batches as full graphs, whose prefill kernels
                   take per-request host parameters that change with every batch; use FULL_DECODE_ONLY
================== ===========================================================================================

Defaults: on an NPU, PIECEWISE (vllm-ascend's default). On the emulated device, what vLLM's own CPU backend does by
default, compile (issue 35; its warm start is not slower than vLLM's CPU backend's, docs/graphs.md): with
``npu.emulated_compile`` ``auto`` (or ``inductor``) and no graph setting, FULL_DECODE_ONLY with compiled replay at
:data:`EMULATED_DEFAULT_SIZES` when vLLM's default list is in effect (each size costs a compile once per machine,
cached on disk), eager, logged, for the features of :func:`emulated_default_fallback`. ``npu.emulated_compile=none``,
``npu.graph_mode='eager'`` or ``--enforce-eager`` run eagerly.

``npu.graph_mode``: ``auto`` follows the above; ``eager`` / ``piecewise`` / ``full_decode_only`` set the mode (an
explicit, different ``cudagraph_mode`` is a conflict). ``--enforce-eager`` with a graph mode is a conflict.
``torchair`` uses FULL_DECODE_ONLY's dispatch and compiles each decode size instead of capturing it
(:mod:`.torchair`). On an NPU it runs GQA and MLA (DeepSeek-V2/V3) decoder models, attention inside the compiled
graph, MoE layers without cross-rank exchanges (unquantized, W8A8_DYNAMIC, static W8A8 or W4A8_DYNAMIC experts) and
npu-quant's dense schemes; DeepSeek-V3.2's sparse attention and the MoE and quant configurations of
:data:`TORCHAIR_NPU_REFUSALS` are refused there with the reason. With attention in the graph (every model but V3.2's, either device) KV connectors that load or save
per layer are refused (:data:`TORCHAIR_KV_TRANSFER`); those that move KV around the step run. Speculative decoding (EAGLE, EAGLE-3, MTP, ngram) runs: vLLM dispatches uniform
verification steps (``1 + k`` tokens per request) to the compiled sizes, whose attention lays them out one row per
token (``GraphDecodeInputs.per_token``); the EAGLE / MTP draft's decode passes are compiled too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_npu.interface import ConfigError, get_logger, is_310p

from .sizes import StreamBudget, thin_sizes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)

#: npu.graph_mode -> vLLM cudagraph_mode name (None: decided by vLLM's knobs).
GRAPH_MODES: dict[str, str | None] = {
    "auto": None,
    "eager": "NONE",
    "piecewise": "PIECEWISE",
    "full_decode_only": "FULL_DECODE_ONLY",
    # FULL_DECODE_ONLY's dispatch (padded pure-decode batches, the rest eager); the model runner compiles instead
    # of capturing (.torchair).
    "torchair": "FULL_DECODE_ONLY",
}


#: What the torchair mode compiles on an NPU, and why the rest is refused (docs/torchair.md, "On an NPU"). torchair's
#: GE compiler (max-autotune) must translate every op of the decode graph to Ascend IR; a node without a converter
#: fails the engine's start. GQA and MLA decoder models compile: their attention is in the graph (the platform
#: answers opaque_attention_op() False; the impls' graph decode paths: npu_scatter_nd_update_ +
#: npu_fused_infer_attention_score, BSH for GQA, BNSD with query_rope/key_rope for MLA, both with converters in
#: torch_npu 2.8.0's torchair), as are the dense ops of npu-ops (npu_rms_norm, npu_add_rms_norm, npu_rotary_mul,
#: npu_swiglu), MoE layers (npu-ops traces them: npu_moe_gating_top_k(_softmax), npu_moe_init_routing_v2,
#: npu_grouped_matmul, npu_swiglu, npu_moe_finalize_routing; with MC2 npu_moe_distribute_dispatch_v2 / combine_v2,
#: sized by the MC2 capacity and chosen once per compiled size), unquantized or with npu-quant's W8A8_DYNAMIC experts
#: (npu_dynamic_quant + npu_grouped_matmul with per-token scales, as vllm-ascend v0.11.0's torchair MoE), static
#: W8A8 experts (npu_quantize per row + npu_grouped_matmul with an int32 bias) or W4A8_DYNAMIC experts (int8 rows x
#: int4 weights with int64 scales and a float32 bias, as v0.11.0's torchair_apply_mlp), and the linear layers of npu-quant's
#: W8A8, W8A8_DYNAMIC, W4A8_DYNAMIC and W4A4_FLATQUANT_DYNAMIC schemes (npu_quantize, npu_dynamic_quant,
#: npu_quant_matmul, npu_weight_quant_batchmatmul, npu_kronecker_quant). Each entry: what is refused -> why.
TORCHAIR_NPU_REFUSALS: dict[str, str] = {
    "sfa": (
        "DeepSeek-V3.2's sparse attention (SFA): its attention stays vLLM's opaque op "
        "(vllm.unified_attention_with_output) in the torchair mode, which takes the layer's name and reads the "
        "step's metadata from vLLM's forward context in Python, so no GE converter can follow it; and the SFA "
        "kernels (torch.ops.custom.npu_sparse_flash_attention / npu_lightning_indexer) have no GE converter in "
        "torch_npu 2.8.0's torchair: they come with Ascend's custom_ops Python package, which vllm-ascend v0.11.0 "
        "imports for DeepSeek-V3.2 (worker_v1.py; its torchair SFA calls them inside GE graphs, so their converters "
        "must come with it too) and which is not a dependency of torch_npu or of this plugin, so a graph decode path "
        "could not be compiled either"
    ),
    "moe_quantized": (
        "quantized MoE models whose routed experts' quant types cannot be read from the checkpoint's description "
        "(quant_model_description.json or config.json's quantization_config): only W8A8_DYNAMIC, static W8A8 "
        "and W4A8_DYNAMIC experts were checked against torchair's converters"
    ),
    "moe_data_parallel": (
        "MoE models with data parallel > 1 without expert parallelism or with tensor parallel > 1: in the torchair "
        "mode only expert parallelism over DP ranks with attention TP 1 (all-gather and reduce-scatter of static "
        "shapes over the EP group, or MC2) has been compiled and run; without expert parallelism (every expert "
        "sliced over the DP x TP ranks, the layer's static gather over the DP group) and with TP > 1 (that gather "
        "plus the TP all-reduce) the graphs have not"
    ),
    "quant_c8": (
        "checkpoints with an int8 KV cache (C8): the graph decode attention path has not been checked against it"
    ),
    "quant_float32": (
        "quantized checkpoints served in float32: torchair's npu_quant_matmul converter takes float16, bfloat16, "
        "int8 or int32 output only (it raises for float32); serve them with --dtype bfloat16 or float16"
    ),
    "quant_other": (
        "quantization methods other than npu-quant's 'ascend': only its schemes' kernels were checked against "
        "torchair's GE converters"
    ),
}


#: Why the torchair mode refuses a layer-wise KV connector on every device when attention is in its graph (``{}``: the
#: connector's class). Connectors whose per-layer hooks are empty (npu-kv's Mooncake connector, vLLM's Nixl and
#: Offloading connectors) run: their loads and saves happen in ``start_load_kv`` / ``wait_for_save`` /
#: ``get_finished``, which vLLM's model runner calls around the model's forward, outside the compiled step.
TORCHAIR_KV_TRANSFER = (
    "npu.graph_mode='torchair' conflicts with the KV connector {} (--kv-transfer-config): it loads or saves KV per "
    "layer (wait_for_layer_load / save_kv_layer), which vLLM calls only inside its opaque attention op, and with "
    "attention inside the compiled graph vLLM's layers call the attention impl directly, which skips them; use a "
    "connector that moves KV around the step (MooncakeConnector, NixlConnector, OffloadingConnector), or "
    "npu.graph_mode='full_decode_only' or 'piecewise'"
)

#: The connector hooks vLLM calls per layer, only from inside its opaque attention op
#: (``wait_for_kv_layer_from_connector`` / ``maybe_save_kv_layer_to_connector``).
LAYER_HOOKS = ("wait_for_layer_load", "save_kv_layer")


def _empty_function(fn: Any) -> bool:
    """Whether ``fn``'s body does nothing (``pass`` or a docstring: its bytecode only returns None)."""
    import dis

    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    for ins in dis.get_instructions(code):
        if ins.opname in ("RESUME", "NOP", "RETURN_VALUE"):
            continue
        if ins.opname in ("LOAD_CONST", "RETURN_CONST") and ins.argval is None:
            continue
        return False
    return True


def layerwise_connector(kv_transfer_config: Any) -> str | None:
    """The class name of ``kv_transfer_config``'s connector when it does work in a per-layer hook
    (:data:`LAYER_HOOKS`; or when its class cannot be resolved), None when those hooks are empty functions: then
    nothing of it runs inside the model's forward, and the torchair mode can compile that forward."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        cls = KVConnectorFactory.get_connector_class(kv_transfer_config)
    except Exception as error:  # an unknown name: vLLM's own error follows when the engine builds the connector
        return f"{getattr(kv_transfer_config, 'kv_connector', None)!r} ({error})"
    if all(_empty_function(getattr(cls, hook, None)) for hook in LAYER_HOOKS):
        return None
    return cls.__name__


def _num_experts(vllm_config: VllmConfig) -> int:
    model = vllm_config.model_config
    text = getattr(model, "hf_text_config", None) if model is not None else None
    for name in ("moe_num_experts", "num_experts", "n_routed_experts", "num_local_experts"):  # vLLM's names
        value = getattr(text, name, 0)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def sparse_attention(vllm_config: VllmConfig) -> bool:
    """Whether the model runs DeepSeek-V3.2's sparse attention (SFA): its HF config has ``index_topk``, vLLM's own
    test (``vllm/model_executor/models/config.py``). Its attention stays vLLM's opaque op in the torchair mode."""
    model = vllm_config.model_config
    return model is not None and hasattr(getattr(model, "hf_config", None), "index_topk")


def _quant_refusal(vllm_config: VllmConfig, moe: bool) -> str | None:
    from vllm_npu.interface import QUANT_METHOD, expert_quant_types, quant_types

    model = vllm_config.model_config
    method = getattr(model, "quantization", None)
    if not method:
        return None
    if method != QUANT_METHOD:
        return "quant_other"
    hf_config = getattr(model, "hf_config", None)
    types = quant_types(getattr(model, "model", None), getattr(hf_config, "quantization_config", None)) or frozenset()
    if "C8" in types:
        return "quant_c8"
    import torch

    if getattr(model, "dtype", None) == torch.float32:
        return "quant_float32"
    if not moe:
        return None
    experts = expert_quant_types(getattr(model, "model", None), getattr(hf_config, "quantization_config", None))
    if experts is None:
        return "moe_quantized"
    return None


def _moe_refusal(vllm_config: VllmConfig) -> str | None:
    parallel = vllm_config.parallel_config
    if getattr(parallel, "data_parallel_size", 1) > 1 and (
        not getattr(parallel, "enable_expert_parallel", False) or getattr(parallel, "tensor_parallel_size", 1) > 1
    ):
        return "moe_data_parallel"
    return None


def torchair_npu_refusal(vllm_config: VllmConfig) -> str | None:
    """Why ``npu.graph_mode='torchair'`` cannot run this engine on an NPU, or None (:data:`TORCHAIR_NPU_REFUSALS`)."""
    model = vllm_config.model_config
    moe = _num_experts(vllm_config) > 0
    if sparse_attention(vllm_config):
        key: str | None = "sfa"
    else:
        key = (_quant_refusal(vllm_config, moe) if model is not None else None) or (
            _moe_refusal(vllm_config) if moe else None
        )
    if key is None:
        return None
    return (
        f"npu.graph_mode='torchair' is not supported on an NPU for {TORCHAIR_NPU_REFUSALS[key]}. Use "
        "npu.graph_mode='full_decode_only' (ACL graphs whose attention kernels are updated every step) or 'piecewise'"
    )


#: Why the torchair mode refuses a C8 checkpoint (int8 KV cache) on every device when attention is in its graph.
TORCHAIR_C8 = (
    "npu.graph_mode='torchair' does not run an int8 KV cache (C8 checkpoint): its compiled decode attention has no "
    "C8 path; use npu.graph_mode='full_decode_only' or 'piecewise'"
)


#: The emulated device's default capture sizes (FULL_DECODE_ONLY, compiled): each size is one compile at the first
#: start (seconds to tens of seconds; later starts load it from the on-disk cache); larger decode batches run eagerly.
EMULATED_DEFAULT_SIZES = (1, 2, 4, 8, 16)

#: The reason logged for the emulated device's default: compiled graphs, as vLLM's CPU backend compiles by default.
EMULATED_DEFAULT = (
    "emulated device, vLLM's default cudagraph_mode: FULL_DECODE_ONLY with compiled replay (vLLM compiles by "
    "default; compiled once per machine, then loaded from the on-disk cache); --enforce-eager, "
    "npu.graph_mode='eager' or npu.emulated_compile='none' runs eagerly"
)

#: The reason logged for the emulated device's default with ``npu.emulated_compile=none``.
EMULATED_EAGER = (
    "emulated device with npu.emulated_compile=none and vLLM's default cudagraph_mode: eager (the default, 'auto', "
    "runs FULL_DECODE_ONLY graphs with compiled replay)"
)


def emulated_default_fallback(vllm_config: VllmConfig) -> str | None:
    """Why the emulated device's default (compiled FULL_DECODE_ONLY) falls back to eager for this engine, or None.

    Kept eager: the combinations the compiled replay was not verified with on the emulated device (speculative
    decoding, KV transfer, more than one rank, sleep mode) and pooling models, whose steps are never pure decodes;
    they still run graphs when asked for explicitly."""
    p = vllm_config.parallel_config
    ranks = {
        "tensor": getattr(p, "tensor_parallel_size", 1),
        "pipeline": getattr(p, "pipeline_parallel_size", 1),
        "data": getattr(p, "data_parallel_size", 1),
    }
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "a KV connector"
    if any(n > 1 for n in ranks.values()):
        return ", ".join(f"{k} parallel {n}" for k, n in ranks.items() if n > 1)
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        return "sleep mode"
    if getattr(vllm_config.model_config, "runner_type", None) == "pooling":
        return "a pooling model (no decode steps to replay)"
    return None


def vllm_default_sizes(vllm_config: VllmConfig) -> list[int]:
    """vLLM's default capture sizes for this config (``VllmConfig._set_cudagraph_sizes`` with no sizes configured),
    ascending; [] when the scheduler config does not say.

    vLLM 0.11.0 derives them from the scheduler's ``cuda_graph_sizes`` (default ``[min(2 * max_num_seqs, 512)]``):
    1, 2, 4 and the multiples of 8 up to it. 0.11.1 dropped that field: the largest size is
    ``min(2 * max_num_seqs, 512, max_num_batched_tokens)`` (or ``compilation_config.max_cudagraph_capture_size``), the
    list 1, 2, 4, the multiples of 8 below 256, then the multiples of 16 (0.11.2 the same). Which one applies is read
    from the scheduler config (``SchedulerConfig.cuda_graph_sizes`` in ``_vllm_surface.py``)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    max_tokens = getattr(scheduler, "max_num_batched_tokens", None)
    if scheduler is None or max_tokens is None:
        return []
    if hasattr(scheduler, "cuda_graph_sizes"):  # vLLM 0.11.0
        graph_sizes = list(scheduler.cuda_graph_sizes or [])
        if len(graph_sizes) != 1:
            return []
        return [s for s in [1, 2, 4, *range(8, graph_sizes[0] + 1, 8)] if s <= max_tokens]
    max_seqs = getattr(scheduler, "max_num_seqs", None)
    if not max_seqs:
        return []
    top = min(2 * max_seqs, 512, max_tokens)
    return [s for s in (1, 2, 4) if s <= top] + list(range(8, min(top + 1, 256), 8)) + list(range(256, top + 1, 16))


def _emulated_default_sizes(vllm_config: VllmConfig, sizes: list[int]) -> list[int]:
    """``sizes``, or :data:`EMULATED_DEFAULT_SIZES` (up to ``max_num_seqs``) when they are vLLM's default list."""
    if not sizes or sorted(set(sizes)) != vllm_default_sizes(vllm_config):
        return sizes
    max_seqs = getattr(vllm_config.scheduler_config, "max_num_seqs", None) or max(EMULATED_DEFAULT_SIZES)
    return [s for s in EMULATED_DEFAULT_SIZES if s <= max_seqs] or [1]


def _set_emulated_compile(vllm_config: VllmConfig, value: str) -> None:
    """Write the resolved ``npu.emulated_compile`` into the engine's ``additional_config`` (the workers' graph
    wrappers read it there)."""
    extra = vllm_config.additional_config
    if isinstance(extra, dict):
        section = extra.get("npu")
        extra["npu"] = {**(section if isinstance(section, dict) else {}), "emulated_compile": value}


@dataclass(frozen=True)
class GraphPlan:
    """What :func:`configure_graphs` decided (for the platform's log line and ``npu_runtime_info``)."""

    mode: str  # the CUDAGraphMode name in effect
    capture_sizes: tuple[int, ...]
    reason: str
    compile: str = "none"  # npu.emulated_compile in effect (emulated device; "none" on an NPU)


def _check_torchair(vllm_config: VllmConfig, emulated: bool) -> None:
    """Refuse, by name, what the torchair mode cannot compile for this config (NPU-only refusals, layer-wise KV
    connectors, an int8 KV cache)."""
    refusal = None if emulated else torchair_npu_refusal(vllm_config)
    if refusal is not None:
        raise ConfigError(refusal)
    in_graph = not sparse_attention(vllm_config)  # .torchair.attention_in_graph, for the model of this config
    kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer is not None and in_graph:
        layerwise = layerwise_connector(kv_transfer)
        if layerwise is not None:
            raise ConfigError(TORCHAIR_KV_TRANSFER.format(layerwise))
    cache = getattr(vllm_config, "cache_config", None)
    if in_graph and getattr(cache, "cache_dtype", None) == "int8":
        raise ConfigError(TORCHAIR_C8)


def _emulated_default_mode(vllm_config: VllmConfig, emulated_compile: str) -> tuple[str, str]:
    """The emulated device's mode for vLLM's default ``cudagraph_mode`` (no explicit graph setting): compiled
    FULL_DECODE_ONLY unless ``npu.emulated_compile=none`` or a feature of :func:`emulated_default_fallback`."""
    if emulated_compile == "none":
        return "NONE", EMULATED_EAGER
    fallback = emulated_default_fallback(vllm_config)
    if fallback is not None:
        return "NONE", (
            f"emulated device: the default compiled graphs are not used with {fallback}; eager (ask for a graph "
            "mode explicitly with npu.graph_mode)"
        )
    return "FULL_DECODE_ONLY", EMULATED_DEFAULT


def _resolve_mode(
    vllm_config: VllmConfig, graph_mode: str, emulated: bool, emulated_compile: str = "auto"
) -> tuple[str, str]:
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    model = vllm_config.model_config
    enforce_eager = bool(model is not None and model.enforce_eager)
    # None only when vLLM did not resolve a default (configs built outside VllmConfig): treat it like vLLM's default.
    vllm_mode = compilation.cudagraph_mode or CUDAGraphMode.FULL_AND_PIECEWISE
    requested = GRAPH_MODES[graph_mode]
    if is_310p():  # eager only (npu.graph_mode itself was checked by .._chip_gate)
        from .._chip_gate import eager_only_310p

        return eager_only_310p(vllm_mode, enforce_eager)
    if graph_mode == "torchair":
        _check_torchair(vllm_config, emulated)
    if enforce_eager:
        if requested not in (None, "NONE"):
            raise ConfigError(
                f"npu.graph_mode={graph_mode!r} conflicts with enforce_eager=True; drop --enforce-eager or set "
                "npu.graph_mode to 'auto' or 'eager'"
            )
        return "NONE", "enforce_eager"
    if getattr(vllm_config, "lora_config", None) is not None:
        # PunicaWrapperNPU picks its kernels per batch on the host (which slots are active, how many segments); a
        # captured graph would replay the first batch's choice for every later batch: wrong tokens, no error.
        explicit = requested not in (None, "NONE") or vllm_mode not in (
            CUDAGraphMode.FULL_AND_PIECEWISE,
            CUDAGraphMode.NONE,
        )
        if explicit:
            chosen = (
                f"npu.graph_mode={graph_mode!r}"
                if requested is not None
                else (f"compilation_config.cudagraph_mode={vllm_mode.name}")
            )
            raise ConfigError(
                f"{chosen} conflicts with LoRA (--enable-lora): the NPU LoRA kernels choose their work per batch on "
                "the host, which a captured graph would freeze; set npu.graph_mode to 'eager' (or "
                "compilation_config.cudagraph_mode to NONE, or --enforce-eager) to serve LoRA adapters"
            )
        return "NONE", "LoRA: the NPU LoRA kernels choose their work per batch on the host, so graphs stay off"
    if requested is not None:
        # FULL_AND_PIECEWISE is also vLLM's default, so it cannot conflict with an explicit npu.graph_mode.
        if vllm_mode not in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode[requested]):
            raise ConfigError(
                f"npu.graph_mode={graph_mode!r} conflicts with compilation_config.cudagraph_mode="
                f"{vllm_mode.name}; set only one of them"
            )
        return requested, f"npu.graph_mode={graph_mode}"
    if vllm_mode == CUDAGraphMode.FULL:
        raise ConfigError(
            "compilation_config.cudagraph_mode=FULL is not supported on the NPU platform: it captures mixed "
            "prefill/decode batches as full graphs, and the NPU prefill attention kernels take per-request host "
            "parameters that differ in every batch; use cudagraph_mode FULL_DECODE_ONLY (full graphs for decode "
            "batches) or PIECEWISE"
        )
    if vllm_mode == CUDAGraphMode.FULL_AND_PIECEWISE:
        if emulated:
            return _emulated_default_mode(vllm_config, emulated_compile)
        return "PIECEWISE", (
            "cudagraph_mode FULL_AND_PIECEWISE (vLLM's default) -> PIECEWISE: full graphs are captured only for "
            "pure-decode batches (cudagraph_mode FULL_DECODE_ONLY)"
        )
    return vllm_mode.name, f"compilation_config.cudagraph_mode={vllm_mode.name}"


def _check_sizes(vllm_config: VllmConfig, sizes: list[int]) -> None:
    scheduler = getattr(vllm_config, "scheduler_config", None)
    max_tokens = getattr(scheduler, "max_num_batched_tokens", None) or max([1, *sizes])
    bad = [s for s in sizes if not isinstance(s, int) or s < 1 or s > max_tokens]
    if bad:
        raise ConfigError(
            f"compilation_config.cudagraph_capture_sizes holds {bad}: every capture size must be an integer in "
            f"[1, max_num_batched_tokens={max_tokens}]; fix the list (or raise --max-num-batched-tokens)"
        )


def _num_layers(vllm_config: VllmConfig) -> int:
    model = vllm_config.model_config
    if model is None or not hasattr(model, "get_num_layers"):
        return 1
    return int(model.get_num_layers(vllm_config.parallel_config))


def _draft_layers(vllm_config: VllmConfig) -> int:
    """Layers of the draft model captured with the target (EAGLE / EAGLE-3 / MTP), 0 without one.

    vLLM captures the draft model's pieces at every capture size too (``EagleProposer`` under PIECEWISE). As
    vllm-ascend, the draft's ``hf_config.num_hidden_layers`` is counted (for an MTP draft that is the target's layer
    count: vLLM keeps it in the draft config, so the count errs on the safe side). ngram has no draft model."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not callable(getattr(spec, "use_eagle", None)) or not spec.use_eagle():
        return 0
    draft = getattr(spec, "draft_model_config", None)
    return int(getattr(getattr(draft, "hf_config", None), "num_hidden_layers", 0) or 0)


def stream_budget(vllm_config: VllmConfig, mode: str) -> StreamBudget:
    """The capture-size budget of an engine in graph mode ``mode`` (PIECEWISE / FULL_DECODE_ONLY), :mod:`.sizes`.

    PIECEWISE captures ``layers + 1`` pieces per size (this pipeline stage's layers: a device holds only its stage's
    pieces; vllm-ascend counts the whole model's layers, the same without pipeline parallel), plus the draft model's
    ``layers + 1`` with an EAGLE/MTP speculative config; FULL_DECODE_ONLY one graph (the draft runs eagerly there)."""
    from vllm_npu.interface import AdditionalConfig

    p = vllm_config.parallel_config
    tp, dp = getattr(p, "tensor_parallel_size", 1), getattr(p, "data_parallel_size", 1)
    if mode == "PIECEWISE":
        graphs = _num_layers(vllm_config) + 1
        draft = _draft_layers(vllm_config)
        if draft:
            graphs += draft + 1
    else:
        graphs = 1
    extra = getattr(vllm_config, "additional_config", None)
    npu = AdditionalConfig.from_vllm(extra if isinstance(extra, dict) else None)
    return StreamBudget(
        graphs_per_size=graphs,
        comm_groups=int(tp > 1) + int(dp > 1),
        expansion_mode=os.environ.get("HCCL_OP_EXPANSION_MODE", ""),
        expert_parallel=bool(getattr(p, "enable_expert_parallel", False)),
        shared_expert_overlap=npu.multistream_overlap_shared_expert,
        moe=vllm_config.model_config is not None and _num_experts(vllm_config) > 0,
        data_parallel=dp > 1,
    )


#: Why graphs are refused with ASCEND_LAUNCH_BLOCKING=1 (vllm-ascend v0.11.0 platform.py refuses it the same way).
LAUNCH_BLOCKING = (
    "ASCEND_LAUNCH_BLOCKING=1 is set, and ACL graphs cannot be captured with blocking launch (every kernel launch "
    "then synchronizes the stream, which a stream being captured does not allow). Unset ASCEND_LAUNCH_BLOCKING (or "
    "set it to 0), or run eagerly with --enforce-eager or npu.graph_mode='eager'; to debug runtime errors with "
    "graphs on, read the CANN plog files instead (default $HOME/ascend/log/debug)"
)


def set_capture_sizes(compilation: Any, sizes: list[int]) -> None:
    """Make ``sizes`` vLLM's capture sizes, with everything vLLM derives from them (compile sizes, the padded batch
    size of each batch size, the largest size). vLLM 0.11.0 does it in ``init_with_cudagraph_sizes`` (sizes kept in
    descending order, ``max_capture_size``); 0.11.1 in ``post_init_cudagraph_sizes`` after the sizes (ascending) and
    ``max_cudagraph_capture_size`` are set. Reads which one the installed vLLM has."""
    if hasattr(compilation, "post_init_cudagraph_sizes"):
        compilation.cudagraph_capture_sizes = sorted(set(sizes))
        compilation.max_cudagraph_capture_size = max(sizes, default=0)
        compilation.post_init_cudagraph_sizes()
    else:
        compilation.cudagraph_capture_sizes = None  # else vLLM keeps the configured list over the argument
        compilation.init_with_cudagraph_sizes(list(sizes))


def configure_graphs(vllm_config: VllmConfig, graph_mode: str, emulated: bool) -> GraphPlan:
    """Set vLLM's compilation config for the resolved graph mode (see the module docstring); returns the plan."""
    from vllm.config import CUDAGraphMode
    from vllm.config.compilation import CompilationConfig
    from vllm_npu.interface import NO_COMPILATION, PIECEWISE, AdditionalConfig, set_compilation_level

    compilation = vllm_config.compilation_config
    extra = getattr(vllm_config, "additional_config", None)
    requested_compile = AdditionalConfig.from_vllm(extra if isinstance(extra, dict) else None).emulated_compile
    mode, reason = _resolve_mode(vllm_config, graph_mode, emulated, requested_compile)
    # The emulated default compiles: graph mode "auto" and vLLM's default cudagraph_mode resolved to graphs.
    emulated_default = reason == EMULATED_DEFAULT
    compile_mode = "none"
    if emulated and mode != "NONE":
        compile_mode = "inductor" if requested_compile == "inductor" or emulated_default else "none"
    if emulated and requested_compile == "auto":
        _set_emulated_compile(vllm_config, compile_mode)
    compilation.cudagraph_mode = CUDAGraphMode[mode]
    if compilation.compile_sizes is None:
        compilation.compile_sizes = []
    model = vllm_config.model_config

    if mode == "NONE":
        set_compilation_level(compilation, NO_COMPILATION)
        if model is not None:
            model.enforce_eager = True
        set_capture_sizes(compilation, [])
        return GraphPlan(mode, (), reason, compile_mode)

    if graph_mode != "torchair" and os.environ.get("ASCEND_LAUNCH_BLOCKING", "0") == "1":
        # Refused on the emulated device too: it enforces the NPU's rules. Not in the torchair mode, which compiles GE
        # graphs instead of capturing ACL graphs (vllm-ascend's check is skipped there too: cudagraph_mode is NONE).
        raise ConfigError(LAUNCH_BLOCKING)
    # One eager forward per size before its capture (vLLM's capture loop runs this many warm-ups in runtime mode
    # NONE): first calls initialise aclnn/ATB ops and HCCL communicators lazily, which is not allowed inside a capture
    # (vllm-ascend sets 1; vLLM 0.11's VllmConfig already sets 1 for V1 without --enforce-eager).
    compilation.cudagraph_num_of_warmups = max(1, compilation.cudagraph_num_of_warmups)
    sizes = list(compilation.cudagraph_capture_sizes or [])
    if emulated_default:
        default_sizes = _emulated_default_sizes(vllm_config, sizes)
        if default_sizes != sizes:
            reason += f"; capture sizes {default_sizes} (vLLM's default list would compile {len(sizes)} sizes)"
            sizes = default_sizes
    _check_sizes(vllm_config, sizes)
    if mode == "PIECEWISE":
        # Dynamo captures the model, split at the attention ops (their metadata changes every step, so they run
        # between the graphs); the pieces stay FX graphs (torch_npu has no supported inductor backend for vLLM).
        set_compilation_level(compilation, PIECEWISE)
        compilation.use_inductor = False
        user_ops = list(compilation.splitting_ops or [])
        compilation.splitting_ops = user_ops + [op for op in CompilationConfig._attention_ops if op not in user_ops]
    else:
        # FULL_DECODE_ONLY: decode batches replay one graph of the whole model; every other batch runs eagerly.
        # Dynamo pieces would run those eagerly too (no inductor on the NPU), so the model is not compiled.
        set_compilation_level(compilation, NO_COMPILATION)
    budget = stream_budget(vllm_config, mode)
    kept = thin_sizes(sizes, budget.max_sizes)
    hint = (
        "; HCCL_OP_EXPANSION_MODE=AIV leaves more streams (and speeds up the collectives)"
        if not budget.aiv and budget.comm_groups
        else ""
    )
    logger.info("ACL graph stream budget (%s): %s%s", mode, budget.describe(), hint)
    if len(kept) < len(set(sizes)):
        logger.info("capture sizes %s -> %s (the stream budget)", sorted(set(sizes)), kept)
    set_capture_sizes(compilation, kept)
    return GraphPlan(mode, tuple(sorted(kept)), reason, compile_mode)
