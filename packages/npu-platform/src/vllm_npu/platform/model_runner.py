# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUModelRunner: vLLM's ``GPUModelRunner`` with the device-specific calls mapped to the active device.

Everything else (input preparation, the persistent batch, chunked prefill, prefix caching, async scheduling,
sampling and logprobs, KV-cache allocation) is vLLM's own code. The overrides:

- ``__init__`` and ``execute_model`` run inside :func:`._device.cuda_stream_api_as`: vLLM creates
  ``torch.cuda.Stream``/``Event`` objects there (eagerly in ``__init__``; per step with async scheduling, in
  ``AsyncGPUModelRunnerOutput``). Within those calls the CUDA stream API is the device's: ``torch.npu`` on an NPU,
  no-op in-order stream/event objects on the emulated device. Objects created there keep working afterwards
  (they are the device's own), so the shim never needs to be process-wide.
- ``_init_device_properties`` and ``_sync_device``: the device's, instead of ``torch.cuda``'s.
- speculative decoding: vLLM's ``RejectionSampler`` (built in ``__init__`` only with a speculative config on the
  last pipeline rank) launches Triton kernels; it is replaced by :class:`.sample.NPURejectionSampler`, the same
  contract in torch.
- ``initialize_kv_cache_tensors``: when several cache layers share a decoder-layer index (DeepSeek-V3.2: the MLA
  latent cache ``...self_attn.attn`` and the indexer key cache ``...self_attn.indexer.k_cache``), vLLM 0.11's
  ``bind_kv_cache`` raises ``NotImplementedError`` on every platform but CUDA/XPU. The override binds them the
  CUDA way (``self.kv_caches`` keeps the first cache of each layer index, every layer's forward-context entry gets
  its own cache); with one cache layer per index it is vLLM's method unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache
from vllm_npu.interface.log import get_logger

from ._device import DeviceBackend, EmulatedDevice, _torch_npu, cuda_stream_api_as

logger = get_logger(__name__)


def device_backend() -> type[DeviceBackend]:
    """The active platform's device backend (the emulated CPU when vLLM runs on another platform, e.g. in tests)."""
    return getattr(current_platform, "device_backend", EmulatedDevice)


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.device_backend = device_backend()
        with cuda_stream_api_as(self.device_backend):
            super().__init__(vllm_config, device)
        if hasattr(self, "rejection_sampler"):
            from .sample import NPURejectionSampler

            self.rejection_sampler = NPURejectionSampler()

    def _init_device_properties(self) -> None:
        if self.device_backend.type == "npu":
            self.device_properties = _torch_npu().get_device_properties(self.device)
            # AI-core count: the NPU's analogue of the SM count (0 if this torch_npu does not report it); vLLM reads
            # it only to decide on cascade attention, which the NPU platform disables.
            self.num_sms = int(getattr(self.device_properties, "cube_core_num", None) or 0)
        else:
            self.device_properties = None  # type: ignore[assignment]  # vLLM types it as CUDA's; no device here
            self.num_sms = 0

    def _sync_device(self) -> None:
        self.device_backend.synchronize(self.device)

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any | None = None) -> Any:
        with cuda_stream_api_as(self.device_backend):
            return super().execute_model(scheduler_output, intermediate_tensors)

    # --- KV cache -----------------------------------------------------------------------------------------------

    def _num_attn_module(self) -> int:
        # vLLM's rule (GPUModelRunner.initialize_kv_cache_tensors): LongCat-Flash has two attention modules per layer.
        return 2 if self.model_config.hf_config.model_type == "longcat_flash" else 1

    def _cache_layers_share_an_index(self, kv_cache_config: KVCacheConfig) -> bool:
        names = {name for group in kv_cache_config.kv_cache_groups for name in group.layer_names}
        names.update(self.shared_kv_cache_layers)
        n = self._num_attn_module()
        return len({extract_layer_index(name, n) for name in names}) < len(names)

    def initialize_kv_cache_tensors(self, kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
        """Allocate, shape and bind the KV caches; returns layer name -> cache tensor (vLLM's contract)."""
        if not self._cache_layers_share_an_index(kv_cache_config):
            return super().initialize_kv_cache_tensors(kv_cache_config)
        kv_caches = self._reshape_kv_cache_tensors(kv_cache_config, self._allocate_kv_cache_tensors(kv_cache_config))
        for layer_name, target_layer_name in self.shared_kv_cache_layers.items():
            kv_caches[layer_name] = kv_caches[target_layer_name]
        n = self._num_attn_module()
        first_per_index: dict[int, str] = {}
        for layer_name in kv_caches:
            first_per_index.setdefault(extract_layer_index(layer_name, n), layer_name)
        forward_context = self.compilation_config.static_forward_context
        bind_kv_cache({name: kv_caches[name] for name in first_per_index.values()}, forward_context, self.kv_caches, n)
        for layer_name, kv_cache in kv_caches.items():
            forward_context[layer_name].kv_cache = [kv_cache]  # a list: vLLM's (V0 virtual-engine) convention
        return kv_caches
