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
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm_npu.interface.log import get_logger

from ._device import DeviceBackend, EmulatedDevice, cuda_stream_api_as

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
            self.device_properties = torch.npu.get_device_properties(self.device)
            # AI-core count: the NPU's analogue of the SM count (None if this torch_npu does not report it).
            self.num_sms = getattr(self.device_properties, "cube_core_num", None)
        else:
            self.device_properties = None
            self.num_sms = 0

    def _sync_device(self) -> None:
        self.device_backend.synchronize(self.device)

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Optional[Any] = None) -> Any:
        with cuda_stream_api_as(self.device_backend):
            return super().execute_model(scheduler_output, intermediate_tensors)
