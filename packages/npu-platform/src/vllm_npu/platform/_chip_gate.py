# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""What an Atlas 300I (Ascend 310P) cannot run, refused by name at config time instead of a kernel error at the
first request. Runs in ``NPUPlatform.check_and_update_config`` (front-end, before any worker exists) on a 310P
(:func:`vllm_npu.interface.is_310p`: the device's name, or ``VLLM_NPU_EMULATED_SOC=310P`` on the emulated device).

The readings behind each refusal:

- **float16 only.** vllm-ascend v0.11.0's 310P tutorial: "the 310I series only supports eager mode and the float16
  data type" (``docs/source/tutorials/single_node_300i.md:5``; its examples: "some ATB ops cannot support bf16 on
  300I series"); torch_npu 2.8.0 documents the 310P ("Atlas 推理系列加速卡产品") attention kernels in float16
  (``_op_plugin_docs.py``, ``npu_prompt_flash_attention`` / ``npu_incre_flash_attention``). The platform offers
  float16 first on a 310P (:func:`model_dtypes`), so ``--dtype auto`` of a bf16 checkpoint becomes float16 with
  vLLM's warning; an explicit other dtype is refused here.
- **Eager only** (same tutorial line; every 310P example passes ``--enforce-eager``): ``npu.graph_mode`` other than
  ``auto`` / ``eager`` (ACL graphs, torchair) is refused; ``auto`` runs eagerly (:mod:`.graphs.config`).
- **No MLA / SFA** (DeepSeek-V2/V3/V3.2, Kimi-K2): vllm-ascend v0.11.0 has no 310P branch in its MLA/SFA backends
  and its 310P KV-cache layout exists only for the GQA backend (``attention/attention_v1.py:72-74``); torch_npu
  2.8.0 documents ``npu_mla_prolog`` / ``npu_fused_infer_attention_score`` for A2/A3 only.
- **No MC2** (``npu.moe_mc2='on'``): vllm-ascend v0.11.0 picks MC2 only on A2/A3 (``worker/model_runner_v1.py``
  ``_select_moe_comm_method``; any other chip raises "Unsupported soc_version").
- **msModelSlim quantized checkpoints**: W8A8_DYNAMIC / W4A8_DYNAMIC / W4A4_FLATQUANT_DYNAMIC need per-token dynamic
  quantization: torch_npu 2.8.0 documents ``npu_dynamic_quant`` for A2/A3 only (``_op_plugin_docs.py:3458-3460``)
  and ``npu_quant_matmul`` on the 310P without ``pertoken_scale`` ("Atlas 推理系列加速卡产品: 不支持pertoken_scale",
  ``:3734``); vllm-ascend v0.11.0's ``quantization/w8a8_dynamic.py`` calls both with no 310P branch (``:82-96``) and
  has 310P branches only in ``quantization/w8a8.py`` (static W8A8). Static W8A8 linear layers run (npu-quant's 310P
  layout); W8A8 MoE experts (vllm-ascend's ``fused_experts_310p``) are not built yet and are refused by name.
  C8 (int8 KV cache) has no 310P NZ layout here.
- **Float16 MoE runs** (Pangu Pro MoE with TP and EP included) on the 310P paths of npu-ops (``ops/moe``: torch gate and
  token permutation, ``npu_grouped_matmul``); vllm-ascend v0.11.0's model runner raises "Unsupported soc_version" for
  expert parallelism on any chip but A2/A3 (``worker/model_runner_v1.py:1904``, its issue #2795) although its 310P
  e2e suite serves Pangu Pro MoE with TP4 + EP: that is the runner's comm-method choice, not the chip.
- **No collectives the 310P's HCCL lacks**: vllm-ascend v0.11.0 replaces ``torch.distributed.broadcast`` of device
  tensors and ``all_reduce`` of int64 ones on a 310P (``patch/platform/patch_distributed.py:56-115``). Under vLLM
  0.11's V1 engine the served paths issue neither (TP's all-reduces are of activations, DP's padding all-reduce is
  int32, the rest runs on the CPU groups; an engine test records the device-group collectives); the two V1 paths
  that would are refused: EPLB (``--enable-eplb``: int64 expert-load all-reduces on the EP device group,
  ``distributed/eplb/eplb_state.py:369, 467, 573``) and pipeline parallelism under the ``external_launcher``
  executor (the last stage broadcasts its logits, ``v1/worker/gpu_model_runner.py:2355-2357``).
- **No KV connectors**: npu-kv's connectors (and vLLM's offloading) move pages in the ND layout; the 310P cache is
  NZ-tiled (``vllm_npu.attention.ops.nz``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm_npu.interface import AdditionalConfig, ConfigError, expert_quant_types, is_310p, quant_types

if TYPE_CHECKING:
    from vllm.config import VllmConfig

CHIP = "the Atlas 300I (Ascend 310P)"
#: vllm-ascend v0.11.0's statement of what the chip serves.
SOURCE = "vllm-ascend v0.11.0's 310P tutorial: 'the 310I series only supports eager mode and the float16 data type'"
#: The dtypes a 310P runs models in, preferred first (vLLM's ``--dtype auto`` takes the first it can).
MODEL_DTYPES_310P = (torch.float16,)
#: msModelSlim quant types and why a 310P cannot run them here.
QUANT_REFUSALS = {
    "W8A8_DYNAMIC": (
        "per-token dynamic quantization: torch_npu 2.8.0 documents npu_dynamic_quant for A2/A3 only and "
        "npu_quant_matmul without pertoken_scale on this chip, and vllm-ascend v0.11.0 has no 310P path for it"
    ),
    "W4A8_DYNAMIC": "per-token dynamic quantization and int4 grouped matmuls are documented for A2/A3 only",
    "W4A4_FLATQUANT_DYNAMIC": "per-token dynamic quantization and int4 matmuls are documented for A2/A3 only",
    "C8": "the int8 KV cache has no 310P (NZ) layout here",
}


def dtype_refusal(dtype: torch.dtype) -> str:
    """The refusal of a model dtype other than float16 on a 310P."""
    why = "the chip has no bfloat16 arithmetic" if dtype == torch.bfloat16 else "its attention kernels run in float16"
    return f"{CHIP} serves models in float16 only, not {dtype} ({why}; {SOURCE}); pass --dtype float16"


def graph_mode_refusal(chosen: str) -> str:
    """The refusal of a graph mode on a 310P (``chosen``: the setting that asked for it)."""
    return (
        f"{chosen} is not supported on {CHIP}: it runs eagerly only ({SOURCE}); set npu.graph_mode to 'auto' or "
        "'eager', or pass --enforce-eager"
    )


def eager_only_310p(cudagraph_mode: Any, enforce_eager: bool) -> tuple[str, str]:
    """The graph mode on a 310P: ``NONE``; an explicit ``compilation_config.cudagraph_mode`` other than vLLM's
    default (``FULL_AND_PIECEWISE``) and ``NONE`` is refused."""
    if cudagraph_mode.name not in ("FULL_AND_PIECEWISE", "NONE") and not enforce_eager:
        raise ConfigError(graph_mode_refusal(f"compilation_config.cudagraph_mode={cudagraph_mode.name}"))
    return "NONE", "Ascend 310P: eager only"


def check_310p_config(vllm_config: VllmConfig, npu_config: AdditionalConfig) -> None:
    """Refuse, by name, what a 310P cannot run (see the module docstring); nothing on other chips."""
    if not is_310p():
        return
    model = vllm_config.model_config
    if model is not None:
        dtype = model.dtype  # resolved to a torch.dtype by ModelConfig (its annotation also admits the CLI strings)
        if isinstance(dtype, torch.dtype) and dtype not in MODEL_DTYPES_310P:
            raise ConfigError(dtype_refusal(dtype))
        if model.use_mla:
            raise ConfigError(
                f"multi-head latent attention (MLA/SFA: DeepSeek-V2/V3/V3.2, Kimi-K2) is not supported on {CHIP}: "
                "vllm-ascend v0.11.0 has no 310P MLA path and torch_npu 2.8.0 documents its MLA kernels for "
                "A2/A3 only; serve a GQA model"
            )
        hf_quant = getattr(model.hf_config, "quantization_config", None)
        types = quant_types(model.model, hf_quant) if str(model.quantization) == "ascend" or hf_quant else None
        for qtype in sorted(types or ()):
            if qtype in QUANT_REFUSALS:
                raise ConfigError(
                    f"the checkpoint {model.model!r} uses {qtype}, which is not supported on {CHIP}: "
                    f"{QUANT_REFUSALS[qtype]}; serve the float16 checkpoint"
                )
        experts = expert_quant_types(model.model, hf_quant) if types else None
        if experts:
            raise ConfigError(
                f"the checkpoint {model.model!r} has {', '.join(sorted(experts))} MoE experts, which are not supported "
                f"on {CHIP}: the 310P quantized expert path (vllm-ascend's fused_experts_310p, "
                "npu_quant_grouped_matmul_dequant) is not built in this plugin yet; serve the float16 checkpoint"
            )
    cache = vllm_config.cache_config
    if cache is not None and str(cache.cache_dtype) != "auto":
        raise ConfigError(
            f"kv_cache_dtype={cache.cache_dtype!r} is not supported on {CHIP}: its KV cache is float16 in the NZ "
            "layout; use --kv-cache-dtype auto"
        )
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise ConfigError(
            f"KV transfer (--kv-transfer-config: prefill-decode disaggregation, KV pools, offloading) is not supported "
            f"on {CHIP}: the connectors move ND pages and the 310P KV cache is NZ-tiled; serve without a KV connector"
        )
    _check_310p_collectives(vllm_config)
    if npu_config.moe_mc2 == "on":
        raise ConfigError(
            f"npu.moe_mc2='on' is not supported on {CHIP}: MC2's fused dispatch/combine runs on A2/A3 only "
            "(vllm-ascend v0.11.0 picks MC2 only there); set npu.moe_mc2 to 'auto' or 'off'"
        )
    if npu_config.graph_mode not in ("auto", "eager"):
        raise ConfigError(graph_mode_refusal(f"npu.graph_mode={npu_config.graph_mode!r}"))


def _check_310p_collectives(vllm_config: VllmConfig) -> None:
    """Refuse the vLLM paths that issue collectives vllm-ascend v0.11.0 replaces on a 310P (module docstring)."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "enable_eplb", False):
        raise ConfigError(
            f"--enable-eplb is not supported on {CHIP}: vLLM's EPLB all-reduces int64 expert loads on the EP device "
            "group, which vllm-ascend v0.11.0 never sends to the 310P's HCCL (it replaces int64 all_reduce there "
            "with an all_gather, patch_distributed.py); serve without EPLB"
        )
    if getattr(parallel, "pipeline_parallel_size", 1) > 1 and (
        getattr(parallel, "distributed_executor_backend", None) == "external_launcher"
    ):
        raise ConfigError(
            f"pipeline parallelism under the external_launcher executor is not supported on {CHIP}: its last stage "
            "broadcasts the logits on the device group, a broadcast vllm-ascend v0.11.0 never sends to the 310P's HCCL "
            "(it replaces it there with an all_gather, patch_distributed.py); use the mp or ray executor"
        )
