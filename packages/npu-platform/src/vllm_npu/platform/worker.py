# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUWorker: vLLM's GPU ``Worker`` on the NPU or the emulated device.

Inherited unchanged: model loading, KV-cache spec, ``execute_model``, warm-up. Overridden where the base is CUDA:

- ``__init__``: fixes the process's kernel backend (``npu.kernels``) and runs every installed component's worker
  hooks (``vllm_npu.interface.registry.init_worker``) before vLLM builds anything.
- ``init_device``: device selection and the distributed environment on the platform's backend (HCCL / gloo); on an
  NPU also torch_npu's ATB registration and a tiny ATB kernel (:mod:`._atb`: a missing or mismatched NNAL fails here
  with the fix, not in the first attention forward).
- the profiler (``VLLM_TORCH_PROFILER_DIR``): torch_npu's with NPU activity on an NPU, torch's CPU profiler on the
  emulated device (:mod:`._profiler`), started and stopped by ``profile(is_start)``.
- ``determine_available_memory``: NPU = profile run + allocator peak, honouring ``gpu_memory_utilization``;
  emulated = profile run + an explicit KV budget (``npu.emulated_kv_cache_gb`` or
  ``VLLM_NPU_EMULATED_KV_CACHE_GB``), because the CPU has no device memory to measure.
- ``sleep``/``wake_up`` without CUDA's ``CuMemAllocator`` (:mod:`.sleep`): the storages of the weights and the KV
  cache shrunk to zero bytes and regrown, every static graph of the engine dropped at ``sleep`` and captured again
  once ``wake_up`` has restored both.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
from typing import Any

import torch
import vllm.distributed.kv_transfer as kv_transfer
import vllm.envs as envs
from vllm.model_executor import set_random_seed
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.utils import report_usage_stats
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm_npu.interface import (
    AdditionalConfig,
    ConfigError,
    DeviceMode,
    EnvConfig,
    compilation_level,
    configure_kernels,
    current_mode,
    get_logger,
    init_worker,
)

from ._device import device_backend
from .model_runner import NPUModelRunner
from .sleep import SleepState, tensors_of

logger = get_logger(__name__)

GiB = 1 << 30
MiB = 1 << 20


#: vLLM 0.11.1 creates the worker's KV connector in ``Worker.initialize_from_config`` (it needs the KV cache config:
#: ``ensure_kv_transfer_initialized`` gained ``kv_cache_config``), no longer in ``init_worker_distributed_environment``.
KV_CONNECTOR_AT_KV_CACHE_INIT = (
    "kv_cache_config" in inspect.signature(kv_transfer.ensure_kv_transfer_initialized).parameters
)


def emulated_kv_cache_setting(additional_config: Any, environ: dict[str, str] | None = None) -> tuple[float, str]:
    """The emulated device's KV budget in GiB and the setting it comes from (``npu.emulated_kv_cache_gb`` if set,
    else ``VLLM_NPU_EMULATED_KV_CACHE_GB``)."""
    npu_config = AdditionalConfig.from_vllm(additional_config)
    if npu_config.emulated_kv_cache_gb is not None:
        return npu_config.emulated_kv_cache_gb, "npu.emulated_kv_cache_gb"
    return EnvConfig.from_environ(environ).EMULATED_KV_CACHE_GB, "VLLM_NPU_EMULATED_KV_CACHE_GB"


def check_emulated_kv_budget(vllm_config: Any, kv_cache_spec: dict[str, Any], budget: int) -> None:
    """Raise :class:`ConfigError` naming the emulated KV setting when ``budget`` (bytes) cannot hold the KV cache of
    one request of ``max_model_len`` tokens (vLLM's own check, ``check_enough_kv_cache_memory``, would point at
    ``gpu_memory_utilization``, which the emulated device does not read)."""
    from vllm.v1.core.kv_cache_utils import max_memory_usage_bytes

    if not kv_cache_spec:
        return
    needed = max_memory_usage_bytes(vllm_config, kv_cache_spec.values())
    if needed <= budget:
        return
    gib, source = emulated_kv_cache_setting(vllm_config.additional_config)
    max_len = vllm_config.model_config.max_model_len
    raise ConfigError(
        f"{source}={gib:g} GiB ({budget / MiB:.3f} MiB) is too small for one request of max_model_len={max_len}: "
        f"its KV cache needs {needed / MiB:.3f} MiB ({needed / GiB:.6f} GiB); raise {source} to at least "
        f"{needed / GiB:.6f}, or lower max_model_len (gpu_memory_utilization does not apply to the emulated device)"
    )


def emulated_kv_cache_bytes(additional_config: Any, environ: dict[str, str] | None = None) -> int:
    """The emulated device's KV budget in bytes: ``npu.emulated_kv_cache_gb`` if set, else
    ``VLLM_NPU_EMULATED_KV_CACHE_GB`` (both validated: a float in (0, 1024] GiB), checked against the host's
    available memory."""
    gib, source = emulated_kv_cache_setting(additional_config, environ)
    budget = int(gib * GiB)
    available, _ = device_backend().mem_get_info()
    if budget > available:
        raise ConfigError(
            f"{source}={gib} GiB exceeds the host's available memory ({available / GiB:.2f} GiB); lower it"
        )
    return budget


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _qualname(obj: Any) -> str | None:
    """The class path of ``obj``'s type, or None for None."""
    return None if obj is None else _class_path(type(obj))


def _multi_token_decode_builds(runner: Any) -> dict[str, int]:
    """``multi_token_decode_builds`` of every attention metadata builder of ``runner`` that counts them, summed per
    builder class path."""
    counts: dict[str, int] = {}
    for group in getattr(runner, "attn_groups", []):
        for attn_group in group:
            for builder in getattr(attn_group, "metadata_builders", []):
                n = getattr(builder, "multi_token_decode_builds", None)
                if isinstance(n, int):
                    key = _qualname(builder) or ""
                    counts[key] = counts.get(key, 0) + n
    return counts


class NPUWorker(Worker):
    # vLLM's Worker types it as GPUModelRunner; ours always builds the subclass (init_device).
    model_runner: NPUModelRunner
    # torch's profiler on the emulated device, torch_npu's on an NPU, None without VLLM_TORCH_PROFILER_DIR.
    profiler: Any

    def __init__(
        self,
        vllm_config: Any,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        mode = current_mode()
        if mode is None:
            raise RuntimeError(
                "NPUWorker runs only when the NPU platform is active (VLLM_NPU_DEVICE=npu|emulated|auto)"
            )
        npu_config = AdditionalConfig.from_vllm(vllm_config.additional_config)
        self.kernel_backend = configure_kernels(npu_config.kernels)
        self.components = init_worker(vllm_config, mode)
        self.device_mode = mode
        self.sleep_state = SleepState()  # what sleep() released, until wake_up() restores it
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        # vLLM's Worker built a CUDA-activity torch profiler (constructed, never started): replace it.
        self.profiler = None
        if envs.VLLM_TORCH_PROFILER_DIR:
            from ._profiler import build_profiler

            self.profiler = build_profiler(envs.VLLM_TORCH_PROFILER_DIR, emulated=self.emulated)
        logger.info(
            "NPUWorker rank %d: %s device, %s kernels, components %s",
            rank,
            mode.value,
            self.kernel_backend,
            ", ".join(self.components),
        )

    @property
    def emulated(self) -> bool:
        return self.device_mode is DeviceMode.EMULATED

    def profile(self, is_start: bool = True) -> None:
        """Start or stop the profiler (the trace is written at stop); on the emulated device rank 0 also prints the
        CPU-time table (vLLM's sorts by CUDA time, which a CPU trace lacks)."""
        if self.profiler is None:
            raise RuntimeError("Profiler is not enabled: set VLLM_TORCH_PROFILER_DIR")
        if is_start:
            self.profiler.start()
            return
        self.profiler.stop()
        if self.emulated and self.local_rank == 0:
            print(self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))

    # --- device and distributed init ----------------------------------------------------------------------------

    def init_device(self) -> None:
        backend = device_backend()
        if self.emulated and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
            # The reference kernels run decode-sized tensors, where intra-op threads only add OpenMP spin-waits;
            # on a loaded host these cost 30x (measured: 11.7 vs 346 ms per decode step, benchmarks/
            # decode_throughput.py, 2 cores at load 13). OMP_NUM_THREADS set by the user wins.
            logger.info(
                "emulated device: torch intra-op threads %d -> 1 (set OMP_NUM_THREADS to choose)",
                torch.get_num_threads(),
            )
            torch.set_num_threads(1)
        self.device = backend.torch_device(self.local_rank)
        current_platform.set_device(self.device)
        dtype = self.model_config.dtype
        assert isinstance(dtype, torch.dtype)  # ModelConfig resolves "auto"/strings to a torch.dtype at init
        current_platform.check_if_supports_dtype(dtype)
        if not self.emulated:
            # Before the distributed init: an NNAL problem stops every rank before any HCCL rendezvous.
            from ._atb import prepare_atb

            prepare_atb(self.device)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        if self.model_config.seed is not None:  # seeding with None is a no-op in vLLM's seed_everything
            set_random_seed(self.model_config.seed)

        if not self.emulated:
            # The snapshot below is the baseline of the NPU's KV budget: collect first so dead tensors don't count.
            # The emulated device's budget is fixed (VLLM_NPU_EMULATED_KV_CACHE_GB) and reads no snapshot, so it
            # skips the full collection (~0.5 s with vLLM and torch imported, benchmarks/engine_init.py).
            gc.collect()
        backend.empty_cache()
        self.init_free_memory, self.total_memory = backend.mem_get_info(self.device)
        # Device memory in use outside torch's allocator at start-up (runtime, HCCL, other processes).
        self.init_non_torch_memory = (self.total_memory - self.init_free_memory) - backend.memory_reserved(self.device)
        self.requested_memory = self.total_memory * self.cache_config.gpu_memory_utilization
        if not self.emulated and self.init_free_memory < self.requested_memory:
            raise ValueError(
                f"free NPU memory at start-up ({self.init_free_memory / GiB:.2f}/{self.total_memory / GiB:.2f} GiB) "
                f"is less than gpu_memory_utilization={self.cache_config.gpu_memory_utilization} "
                f"({self.requested_memory / GiB:.2f} GiB); lower --gpu-memory-utilization or free the device"
            )
        self.model_runner = NPUModelRunner(self.vllm_config, self.device)
        if self.rank == 0:
            report_usage_stats(self.vllm_config)

    def _maybe_get_memory_pool_context(self, tag: str) -> contextlib.AbstractContextManager:
        # No address-keeping allocator (vllm-ascend's CaMemAllocator needs a C extension; see .sleep): sleep
        # shrinks the storages and wake-up re-captures the graphs instead.
        return contextlib.nullcontext()

    # --- memory -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes available for the KV cache (the profile run always happens: it exercises the largest batch)."""
        if kv_bytes := self.cache_config.kv_cache_memory_bytes:
            self.model_runner.profile_run()
            logger.info("KV cache: %.3f GiB as set by kv_cache_memory_bytes", kv_bytes / GiB)
            return int(kv_bytes)
        if self.emulated:
            self.model_runner.profile_run()
            budget = emulated_kv_cache_bytes(self.vllm_config.additional_config)
            check_emulated_kv_budget(self.vllm_config, self.model_runner.get_kv_cache_spec(), budget)
            logger.info("KV cache on the emulated device: %.3f GiB", budget / GiB)
            return budget

        backend = device_backend()
        backend.empty_cache()
        backend.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run()
        backend.synchronize(self.device)
        peak = backend.peak_memory_allocated(self.device)  # weights + the largest activation set
        free_after, _ = backend.mem_get_info(self.device)
        non_torch_after = (self.total_memory - free_after) - backend.memory_reserved(self.device)
        non_torch_increase = max(0, non_torch_after - self.init_non_torch_memory)  # HCCL buffers, workspaces
        # Graphs are captured after the KV cache is allocated, into their own pool: keep its size out of the budget.
        estimate = getattr(self.model_runner, "estimate_graph_memory", None)
        graph_pool = int(estimate()) if estimate is not None else 0
        available = int(self.requested_memory - peak - non_torch_increase - graph_pool)
        if available <= 0:
            raise ValueError(
                f"no NPU memory left for the KV cache: weights and activations peak at {peak / GiB:.2f} GiB "
                f"(+{non_torch_increase / GiB:.2f} GiB outside torch, +{graph_pool / GiB:.2f} GiB for the graph "
                f"pool) of the {self.requested_memory / GiB:.2f} GiB allowed by gpu_memory_utilization; raise "
                "--gpu-memory-utilization, lower --max-num-batched-tokens or the capture sizes, or use more tensor "
                "parallelism"
            )
        logger.info(
            "KV cache: %.2f GiB (peak %.2f GiB, non-torch +%.2f GiB, graph pool %.2f GiB, budget %.2f GiB)",
            available / GiB,
            peak / GiB,
            non_torch_increase / GiB,
            graph_pool / GiB,
            self.requested_memory / GiB,
        )
        gc.collect()
        return available

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        if KV_CONNECTOR_AT_KV_CACHE_INIT:
            # vLLM 0.11.1: the worker's KV connector (--kv-transfer-config) is made here, before the KV cache, from
            # the cache's config; 0.11.0 made it in init_worker_distributed_environment (our init_device calls it).
            kv_transfer.ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)  # type: ignore[call-arg]
        self.model_runner.initialize_kv_cache(kv_cache_config)

    # --- sleep mode ---------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Release device memory (:meth:`.sleep.SleepState.sleep`). Level 1: weights moved to host memory, KV cache
        discarded. Level 2: both discarded (weights are reloaded from the checkpoint on wake-up)."""
        context = self.compilation_config.static_forward_context
        self.sleep_state.sleep(self.model_runner, context, device_backend(), self.device, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate the released memory of ``tags`` (default: all) and, once no tag is asleep, capture the
        graphs again (:meth:`.sleep.SleepState.wake_up`)."""
        self.sleep_state.wake_up(self.model_runner, device_backend(), self.device, tags)

    # --- diagnostics --------------------------------------------------------------------------------------------

    def npu_runtime_info(self) -> dict[str, Any]:
        """What actually runs in this worker (a ``collective_rpc`` target for tests and ``vllm-npu`` tooling)."""
        from vllm.compilation.counter import compilation_counter
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        from .graphs.torchair import TORCHAIR_STATS
        from .graphs.wrapper import GRAPH_STATS

        runner = self.model_runner
        cudagraph_mode = self.vllm_config.compilation_config.cudagraph_mode
        assert cudagraph_mode is not None, "VllmConfig.__post_init__ always sets cudagraph_mode"
        # vLLM's attention layers: Attention, and from 0.11.1 MLAAttention too (AttentionLayerBase covers both; the
        # other subclasses, e.g. Mamba layers, have no impl).
        attn_layers = {
            name: layer
            for name, layer in get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase).items()  # type: ignore[type-abstract]
            if hasattr(layer, "impl")
        }
        backends = sorted({_class_path(layer.get_attn_backend()) for layer in attn_layers.values()})
        impls = sorted({_class_path(type(layer.impl)) for layer in attn_layers.values()})
        context = self.compilation_config.static_forward_context
        kv_shapes = [tuple(t.shape) for t in tensors_of(runner, context, "kv_cache")][:1]
        plugin_modules: dict[str, int] = {}
        for module in runner.get_model().modules():
            if type(module).__module__.startswith("vllm_npu."):
                plugin_modules[type(module).__name__] = plugin_modules.get(type(module).__name__, 0) + 1
        return {
            "platform": _qualname(current_platform),
            "worker": _qualname(self),
            "model_runner": _qualname(runner),
            "attention_backends": backends,
            "attention_impls": impls,
            "device": str(self.device),
            "device_mode": self.device_mode.value,
            # get_soc_version()'s family on an NPU (the runtime is initialised here), VLLM_NPU_EMULATED_SOC's else
            "chip": device_backend().soc(),
            "kernel_backend": self.kernel_backend,
            "components": list(self.components),
            # Modules of the loaded model whose class comes from our layers (CustomOp overrides, model overrides).
            "plugin_modules": dict(sorted(plugin_modules.items())),
            "kv_cache_shape": kv_shapes[0] if kv_shapes else None,
            "block_size": self.cache_config.block_size,
            # Requests with at most this many query tokens are reordered to the front as decodes (None: no reorder).
            "reorder_batch_threshold": runner.reorder_batch_threshold,
            # The speculative-decoding verifier (None without a speculative config).
            "rejection_sampler": _qualname(getattr(runner, "rejection_sampler", None)),
            # The speculative-decoding proposer and its draft model (None without one / for ngram).
            "drafter": _qualname(getattr(runner, "drafter", None)),
            "draft_model": _qualname(getattr(getattr(runner, "drafter", None), "model", None)),
            # Metadata builds whose decodes carried several query tokens per request, per builder class (builders
            # that count them: the MLA backend's).
            "multi_token_decode_builds": _multi_token_decode_builds(runner),
            "rank": self.rank,
            "compilation_level": compilation_level(self.vllm_config.compilation_config),
            "piecewise_graphs_seen": compilation_counter.num_piecewise_graphs_seen,
            "cudagraph_mode": cudagraph_mode.name,
            "capture_sizes": sorted(self.vllm_config.compilation_config.cudagraph_capture_sizes or []),
            # Static graphs of this engine: vLLM's own capture counter (process-wide, so counted from the runner's
            # start), and our per-mode captures/replays and in-graph tasks.
            "cudagraph_captured": compilation_counter.num_cudagraph_captured - runner.cudagraph_captured_before,
            "graphs": GRAPH_STATS.snapshot(),
            # The torchair mode's compiles, recompiles, cache hits/writes and compiled steps (this process).
            "torchair": TORCHAIR_STATS.snapshot(),
            "tp_communicator": type(get_tp_group().device_communicator).__qualname__,
            "tp_backend": str(torch.distributed.get_backend(get_tp_group().device_group)),
            # Bytes released by sleep() and not yet woken up, per tag.
            "sleeping_bytes": self.sleep_state.sleeping_bytes(),
        }
