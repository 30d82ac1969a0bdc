# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM platform classes: :class:`NPUPlatform` and its emulated twin :class:`EmulatedNPUPlatform`.

One hierarchy: every hook is written once, in :class:`NPUPlatform`; the emulated class changes only device facts
(class attributes below and the :mod:`._device` backend). vLLM reads several of these attributes at import time
(``dispatch_key`` in ``direct_register_custom_op``, ``simple_compile_backend`` in ``@torch.compile`` decorators),
which is why the mode is fixed by ``register()`` before ``current_platform`` is first touched.

``torch_npu`` is never imported here: only :mod:`._device`'s NPU functions import it, when they run.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.platforms.interface import Platform, PlatformEnum
from vllm_npu.interface import ENV_SETTINGS, current_device, get_logger

from ._device import DeviceBackend, EmulatedDevice, NPUDevice

if TYPE_CHECKING:
    from torch.distributed import PrefixStore, ProcessGroup
    from vllm.config import VllmConfig
    from vllm.config.cache import BlockSize

logger = get_logger(__name__)

WORKER_CLS = "vllm_npu.platform.worker.NPUWorker"
COMMUNICATOR_CLS = "vllm_npu.platform.communicator.NPUCommunicator"
#: The model dtypes both device modes run, the first being vLLM's fallback for "auto".
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Why the platform starts vLLM's engine core and workers with ``spawn`` (logged once per process).
SPAWN_REASONS = {
    False: "torch_npu cannot re-initialise the NPU runtime in a forked child (torch_npu/npu/__init__.py:246), and "
    "vLLM's own spawn check sees only CUDA/XPU",
    True: "a forked engine core/worker deadlocks once this process ran torch CPU (OpenMP) work, and the emulated "
    "device keeps torch_npu's rule that a forked child cannot re-initialise the device runtime",
}
_spawn_logged: list[bool] = []


def _default_to_spawn(emulated: bool) -> None:
    """``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unless the user set it (an explicit setting wins)."""
    if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ:
        return
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if not _spawn_logged:
        _spawn_logged.append(True)
        logger.info("VLLM_WORKER_MULTIPROC_METHOD=spawn (set it to choose): %s", SPAWN_REASONS[emulated])


class NPUPlatform(Platform):
    """Huawei Ascend NPU (torch_npu, HCCL)."""

    _enum = PlatformEnum.OOT
    device_name: str = "npu"
    device_type: str = "npu"
    dispatch_key: str = "PrivateUse1"
    ray_device_key: str = "NPU"
    device_control_env_var: str = "ASCEND_RT_VISIBLE_DEVICES"
    dist_backend: str = "hccl"
    # torch_npu ships no supported inductor backend for vLLM's standalone helper functions (masked embedding,
    # logprob gather): compiling them would fail or fall back per call.
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = ["ascend"]
    #: Copied by vLLM's Ray executor from the driver to every worker actor (with vLLM's own VLLM_* variables). The
    #: device mode (VLLM_NPU_DEVICE) must already be in the Ray cluster's environment: an actor resolves its
    #: platform before this copy arrives.
    additional_env_vars: list[str] = [s.name for s in ENV_SETTINGS]

    #: The device backend (memory, sync, streams) of this mode.
    device_backend: ClassVar[type[DeviceBackend]] = NPUDevice
    #: Whether this class drives the emulated device.
    emulated: ClassVar[bool] = False
    #: Block size when the user sets none: the NPU attention kernels are tuned for 128-token blocks.
    default_block_size: ClassVar[BlockSize] = 128
    #: Host buffers pinned for async host-to-device copies.
    pin_memory: ClassVar[bool] = True

    def __init__(self) -> None:
        # vLLM instantiates the platform when `current_platform` is first touched and does not swallow errors here:
        # `VLLM_NPU_DEVICE=npu` on a host without an NPU surfaces as this clear error, not a silent fallback.
        # First of all, a vLLM outside the tested releases: one refusal, before any vLLM internal can fail.
        from vllm_npu.interface import SUPPORTED_VLLM, require_tested_vllm

        require_tested_vllm(SUPPORTED_VLLM)
        current_device().raise_if_unusable()
        # Validate the VLLM_NPU_* variables here too: errors raised in check_and_update_config reach the user
        # wrapped in pydantic's ValidationError of VllmConfig, this one arrives as the ConfigError itself.
        from vllm_npu.interface import EnvConfig

        EnvConfig.from_environ()
        super().__init__()

    # --- configuration ------------------------------------------------------------------------------------------

    @staticmethod
    def _select_pd_scheduler(vllm_config: VllmConfig) -> None:
        """With npu-kv's Mooncake connector, its scheduler (vLLM's plus recomputing a request whose KV pull
        failed) replaces vLLM's default one."""
        kv = vllm_config.kv_transfer_config
        if kv is None or not kv.kv_connector or importlib.util.find_spec("vllm_npu.kv") is None:
            return
        from vllm_npu.kv import select_scheduler

        sched = vllm_config.scheduler_config
        # vLLM's MultiConnector (e.g. PD + KV pool) names its connectors in its extra config.
        subs = [str(c.get("kv_connector")) for c in (kv.kv_connector_extra_config or {}).get("connectors") or ()]
        chosen = select_scheduler(kv.kv_connector, sched.scheduler_cls, subs)
        if chosen != sched.scheduler_cls:
            logger.info("KV connector %s: scheduler %s", kv.kv_connector, chosen)
            sched.scheduler_cls = chosen  # type: ignore[assignment]

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm_npu.interface import (
            AdditionalConfig,
            ConfigError,
            EnvConfig,
            check_ascend_settings,
            check_installed_set,
        )

        EnvConfig.from_environ()  # validates every VLLM_NPU_* variable (typos and bad values raise ConfigError)
        extra = vllm_config.additional_config  # vLLM allows any hashable object; ours is a JSON object
        if not isinstance(extra, Mapping):
            raise ConfigError(f"--additional-config must be a JSON object, got a {type(extra).__name__}")
        npu_config = AdditionalConfig.from_vllm(extra)
        # vllm-ascend's --additional-config keys and VLLM_ASCEND_* variables: a message each, instead of silence.
        check_ascend_settings(extra, os.environ, warn=logger.warning)
        check_installed_set()
        cls._claim_quantized_checkpoint(vllm_config)
        from ._chip_gate import check_310p_config

        check_310p_config(vllm_config, npu_config)  # what an Ascend 310P cannot run, refused by name
        cls._int8_kv_cache_for_c8(vllm_config)

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLS
        elif parallel.worker_cls != WORKER_CLS:
            logger.warning(
                "worker_cls=%s was set explicitly; the NPU platform expects %s", parallel.worker_cls, WORKER_CLS
            )
        # vLLM's custom all-reduce is CUDA IPC; HCCL/gloo all-reduce goes through NPUCommunicator.
        parallel.disable_custom_all_reduce = True
        if getattr(parallel, "enable_dbo", False):
            raise ConfigError(
                "--enable-dbo (dual-batch overlap) is not supported on the NPU platform: vLLM runs it through its "
                "UBatchWrapper (CUDA streams, CUDA graphs, CUDA SM partitioning) and DeepEP all-to-all, which have "
                "no NPU counterpart here; remove --enable-dbo"
            )
        cls._select_pd_scheduler(vllm_config)
        from .hybrid import check_hybrid_config

        check_hybrid_config(vllm_config)

        cache = vllm_config.cache_config
        # vLLM types block_size as its Literal of sizes, but the field defaults to None for the platform to fill.
        block_size: int | None = cache.block_size if cache is not None else None
        if cache is not None and block_size is None:
            cache.block_size = cls.default_block_size

        model = vllm_config.model_config
        if model is not None:
            # Cascade attention is a FlashAttention feature; our backends do not implement it.
            model.disable_cascade_attn = True
            # vLLM's own DeepSeek-V3.2 hook sets a cache dtype outside its CacheDType Literal: compare as a str.
            cache_dtype: str | None = cache.cache_dtype if cache is not None else None
            if (
                cache is not None
                and cache_dtype == "fp8_ds_mla"
                and hasattr(getattr(model, "hf_config", None), "index_topk")
            ):
                # vLLM's DeepSeek-V3.2 hook turns "auto" (and any fp8) into its CUDA-only fp8_ds_mla layout; the
                # NPU backends store the MLA/indexer caches in the model dtype.
                logger.warning(
                    "DeepSeek-V3.2: KV cache dtype fp8_ds_mla is not supported on NPUs; using the model dtype"
                )
                cache.cache_dtype = "auto"

        if not cls.emulated and npu_config.emulated_kv_cache_gb is not None:
            logger.warning("npu.emulated_kv_cache_gb is ignored on an NPU (gpu_memory_utilization sizes the KV cache)")
        if not cls.emulated and npu_config.emulated_compile not in ("auto", "none"):
            logger.warning("npu.emulated_compile is ignored on an NPU (it compiles the emulated device's graph twin)")

        from .graphs.config import configure_graphs

        compilation = vllm_config.compilation_config
        plan = configure_graphs(vllm_config, npu_config.graph_mode, cls.emulated)
        # Every CustomOp dispatches to forward_oot, where the ops layer puts the NPU kernels (explicit "-op"
        # entries of the user still disable single ops).
        compilation.custom_ops = ["all", *[op for op in compilation.custom_ops if op.startswith("-")]]

        # vLLM forks its engine core and workers by default and forces spawn only when CUDA/XPU is initialised
        # (vllm.utils._maybe_force_spawn). An NPU needs spawn too: a child forked from a process that initialised
        # torch_npu's runtime fails at its first device call. The emulated device needs it for OpenMP (as vLLM's
        # CPU platform) and keeps the same runtime rule. An explicit user setting wins.
        _default_to_spawn(cls.emulated)

        logger.info(
            "%s: graph mode %s%s (%s), capture sizes %s, block size %s, worker %s",
            cls.__name__,
            plan.mode,
            " + compiled replay" if plan.compile == "inductor" else "",
            plan.reason,
            list(plan.capture_sizes),
            cache.block_size if cache is not None else None,
            parallel.worker_cls,
        )

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        # vLLM calls this before it builds the ModelConfig (and after general plugins loaded, so npu-quant has
        # registered "ascend" if it is here): without the quant layer, "ascend" is registered as the gate that
        # refuses msModelSlim checkpoints with the install command (vLLM would say "Unknown quantization method").
        from vllm_npu.interface import is_available

        if not is_available("quant"):
            from ._quant_gate import register_gate

            register_gate()

    @staticmethod
    def _claim_quantized_checkpoint(vllm_config: VllmConfig) -> None:
        """Use the ``ascend`` quant method for a ModelSlim checkpoint that has ``quant_model_description.json``
        but no ``quantization_config`` in config.json, when the user chose no method; without the quant layer,
        refuse such a checkpoint with the install command (loading it as float weights would be a wrong answer).

        This is the one seam that works for ``LLM(...)`` and ``vllm serve`` alike: vLLM consults quant configs
        (``override_quantization_method``) only when config.json has a ``quantization_config``, and both entry
        points build the ``VllmConfig`` (whose ``__post_init__`` calls this hook after it decided the quant config)
        before any worker starts, so the claimed config reaches every process."""
        from vllm_npu.interface import is_available

        if not is_available("quant"):
            model_config = vllm_config.model_config
            if model_config is None or model_config.quantization is not None:
                return
            from vllm_npu.interface import DESCRIPTION_FILENAME, find_description_file, read_scheme

            if find_description_file(model_config.model) is not None:
                from ._quant_gate import missing_quant_layer

                raise missing_quant_layer(model_config.model, DESCRIPTION_FILENAME, read_scheme(model_config.model))
            return
        from vllm_npu.quant import claim_checkpoint

        claim_checkpoint(vllm_config)

    @staticmethod
    def _int8_kv_cache_for_c8(vllm_config: VllmConfig) -> None:
        """A C8 checkpoint (``kv_quant_type`` / ``kv_cache_type`` ``C8`` in its msModelSlim description, served by the
        ``ascend`` method) gets the int8 KV cache its scales are for: ``cache_dtype="int8"``, which vLLM's runner
        turns into ``torch.int8`` pages (half the bytes per token of a 16-bit cache) and its attention layers pass to
        the backend. vLLM's ``--kv-cache-dtype`` choices do not include int8; vllm-ascend v0.11.0 sets the same field
        from its ``kv_cache_dtype`` additional config (``platform.py:135-138``). An explicit fp8 choice is refused."""
        from vllm_npu.interface import QUANT_METHOD, ConfigError, quant_types

        model, cache = vllm_config.model_config, vllm_config.cache_config
        if model is None or cache is None or getattr(model, "quantization", None) != QUANT_METHOD:
            return
        hf_config = getattr(model, "hf_config", None)
        types = quant_types(getattr(model, "model", None), getattr(hf_config, "quantization_config", None))
        if types is None or "C8" not in types:
            return
        chosen: str = cache.cache_dtype
        if chosen not in ("auto", "int8"):
            raise ConfigError(
                f"--kv-cache-dtype {chosen} conflicts with this C8 checkpoint, whose int8 KV-cache scales need an "
                "int8 cache: leave --kv-cache-dtype at auto"
            )
        if chosen != "int8":
            logger.info("C8 checkpoint: the KV cache is int8 (per-channel scales from the checkpoint)")
        # vLLM's CacheDType Literal has no "int8", which its runner and attention layers take as a plain string.
        cache.cache_dtype = "int8"  # type: ignore[assignment]

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: Any,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int,
        use_v1: bool,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool = False,
        attn_type: str | None = None,
    ) -> str:
        """The attention backend. vLLM 0.11.1 dropped ``use_v1`` from its signature but still calls an override
        that has it positionally as 0.11.0 did, with ``attn_type`` (decoder, encoder...) appended, which the NPU
        backends do not branch on (vLLM 0.11.0 does not pass it)."""
        from vllm_npu.interface import require

        require("attention", "the NPU platform runs attention through the npu-attention layer")
        from vllm_npu.attention import select_backend

        if selected_backend is not None:
            logger.warning("attention backend %s was requested; the NPU platform selects its own", selected_backend)
        return select_backend(
            use_mla=use_mla,
            use_sparse=use_sparse,
            has_sink=has_sink,
            head_size=head_size,
            dtype=dtype,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
        )

    @classmethod
    def get_vit_attn_backend(cls, head_size: int, dtype: torch.dtype) -> Any:
        """The vision-encoder attention vLLM's own ViTs use here: ``TORCH_SDPA``.

        vLLM's towers accept only FLASH_ATTN / TORCH_SDPA / XFORMERS / ROCM_AITER_FA and build the kernel from it;
        of those only SDPA runs on an NPU (plain torch). The Qwen VL towers, npu-models' overrides, ignore this
        answer: their attention runs npu-attention's ``vision_attention`` kernel. Stated explicitly rather than
        inherited so that a change of vLLM's default cannot pick a CUDA kernel for us."""
        from vllm.platforms import _Backend

        return _Backend.TORCH_SDPA

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return COMMUNICATOR_CLS

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # Multi-LoRA shrink/expand kernels and the LoRA layer classes for our linear/embedding classes: npu-ops.
        from vllm_npu.interface import require

        require("ops", "LoRA (--enable-lora) on the NPU is provided by the npu-ops layer")
        return "vllm_npu.ops.lora.PunicaWrapperNPU"  # vLLM resolves a dotted module.attr name, not module:attr

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Attention runs as one registered op (`vllm.unified_attention_with_output`, under `dispatch_key`), which
        # is also the split point of piecewise graphs. Except in the torchair mode with a GQA or MLA model: vLLM's
        # layer then sets Attention.use_direct_call and calls the impl directly, so attention is traced into the
        # compiled decode graph (.graphs.torchair; DeepSeek-V3.2's sparse attention keeps the op).
        # vLLM asks once per attention layer, while the model is built under the engine's config.
        from vllm.config import get_current_vllm_config

        from .graphs.torchair import attention_in_graph

        return not attention_in_graph(get_current_vllm_config())

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        # ACL graphs on an NPU, the static-graph twin on the emulated device (see .graphs).
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        from .graphs import WRAPPER_CLS

        return WRAPPER_CLS

    def graph_pool_handle(self) -> Any:
        """The memory pool token every graph shares (vLLM's ``get_global_graph_pool`` caches it per class)."""
        return self.device_backend.graph_pool_handle()

    @classmethod
    def stateless_init_device_torch_dist_pg(
        cls,
        backend: str,
        prefix_store: PrefixStore,
        group_rank: int,
        group_size: int,
        timeout: timedelta,
    ) -> ProcessGroup:
        """A process group outside torch.distributed's global state (vLLM's
        ``stateless_init_torch_distributed_process_group`` for non-gloo backends): HCCL on an NPU, gloo on the
        emulated device (:mod:`._stateless_pg`)."""
        from ._stateless_pg import stateless_device_group

        return stateless_device_group(backend, prefix_store, group_rank, group_size, timeout, emulated=cls.emulated)

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # vLLM 0.11's hybrid KV-cache manager (attention pages and Mamba-style state pages of one size in one pool):
        # the attention backends build their metadata per KV-cache group, the GDN layers run vLLM's own
        # GDNAttentionBackend builder (torch only), and the runner shapes the pages through GPUModelRunner's
        # _reshape_kv_cache_tensors. Without it vLLM cannot place a hybrid model's state at all.
        return True

    @classmethod
    def is_sleep_mode_available(cls) -> bool:
        return True

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return cls.pin_memory

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        from vllm_npu.interface import is_310p

        if is_310p():  # float16 only: --dtype auto of a bf16 checkpoint becomes float16 (vLLM warns)
            from ._chip_gate import MODEL_DTYPES_310P

            return list(MODEL_DTYPES_310P)
        return list(MODEL_DTYPES)

    @classmethod
    def check_if_supports_dtype(cls, torch_dtype: torch.dtype) -> None:
        from vllm_npu.interface import is_310p

        if is_310p():
            from ._chip_gate import MODEL_DTYPES_310P, dtype_refusal

            if torch_dtype not in MODEL_DTYPES_310P:
                raise ValueError(dtype_refusal(torch_dtype))
            return
        if torch_dtype not in MODEL_DTYPES:
            raise ValueError(
                f"{cls.__name__} runs models in bfloat16, float16 or float32, not {torch_dtype}; pass --dtype "
                "bfloat16 (or float16/float32)"
            )

    # --- device calls -------------------------------------------------------------------------------------------

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> None:
        return None  # no CUDA compute capability: keeps vLLM off capability-gated CUDA kernels

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return cls.device_backend.device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """Not answered, on purpose (as vllm-ascend v0.11.0, which does not define it).

        vLLM calls this only in the front-end process (``EngineArgs._set_default_args``), to pick larger default
        ``max_num_batched_tokens`` / ``max_num_seqs`` for devices of 70 GiB or more, and falls back to the smaller
        defaults on any exception. Answering it on an NPU means ``torch.npu.mem_get_info``, which initialises the
        runtime (an ACL context on the device) in the front-end: its forked children then cannot use the NPU, and
        the context holds device memory that worker 0 needs. No Ascend device of torch_npu 2.8.0's targets reaches
        70 GiB per logical device (Atlas A2 and each A3 die: 64 GB), so the defaults are the same either way; the
        emulated device answers as the NPU does, so both pick the same defaults."""
        raise NotImplementedError("the NPU platform does not read device memory outside worker processes")

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        cls.device_backend.set_device(device)

    @classmethod
    def synchronize(cls, device: Any = None) -> None:
        cls.device_backend.synchronize(device)

    @classmethod
    def empty_cache(cls) -> None:
        cls.device_backend.empty_cache()

    @classmethod
    def mem_get_info(cls, device: Any = None) -> tuple[int, int]:
        return cls.device_backend.mem_get_info(device)

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        """Bytes in use on the device now (NPU: allocator peak after a reset; emulated: process RSS)."""
        return float(cls.device_backend.current_memory_usage(device))


class EmulatedNPUPlatform(NPUPlatform):
    """The emulated NPU: the same platform on the CPU, with the pure-PyTorch reference kernels."""

    device_name: str = "cpu"  # vLLM builds `torch.device(device_name)` for OOT process groups
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    # Ray's NPU resource, as on NPUs: a CPU host declares it (`ray start --resources '{"NPU": 2}'`, or
    # `ray.init(resources=...)`). A custom resource name would not do: vLLM reads each actor's device ids from
    # ray.get_runtime_context().get_accelerator_ids(), which lists only Ray's accelerator resources.
    ray_device_key: str = "NPU"
    # Not under VLLM_NPU_*: vLLM writes this variable for data-parallel ranks, and unknown VLLM_NPU_* names are errors.
    device_control_env_var: str = "NPU_EMULATED_VISIBLE_DEVICES"
    dist_backend: str = "gloo"

    device_backend: ClassVar[type[DeviceBackend]] = EmulatedDevice
    emulated: ClassVar[bool] = True
    # vLLM's own default: the reference kernels have no preferred block size.
    default_block_size: ClassVar[BlockSize] = 16
    # Pinning needs a CUDA driver with the CUDA torch wheel; there is no host-to-device copy to speed up anyway.
    pin_memory: ClassVar[bool] = False
