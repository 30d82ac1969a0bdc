# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``host-offload-npu``: vLLM's ``OffloadingConnector`` (``{"kv_connector": "OffloadingConnector",
"kv_connector_extra_config": {"num_cpu_blocks": N}}``) copies KV blocks between the device and host memory through
the platform.

vLLM 0.11.0's ``CPUOffloadingSpec.get_handlers`` (``vllm/v1/kv_offload/cpu.py``) raises "CPU Offloading is
currently only supported on CUDA GPUs" on any other platform, and its handler (``worker/cpu_gpu.py``) copies with
``torch.cuda.Stream``/``Event`` and the CUDA kernel ``ops.swap_blocks``, which also take a cache as one tensor
blocked on dim 0 (or dim 1 after K/V): our MLA cache is two planes in one buffer (latent then rope), which that copy
would mix up. vLLM leaves no platform hook there (the spec name is the user's; the default one is CUDA's), hence one
patch: on a non-CUDA platform the spec yields :class:`HostOffloadHandler` for both directions; on CUDA vLLM's own.

:class:`HostOffloadHandler` keeps, per cache plane, a host tensor of ``num_cpu_blocks * block_size_factor`` blocks.
NPU: pinned host memory, one copy stream per direction (``torch.npu.Stream``), a block's plane moved by one
``copy_(non_blocking=True)`` on it, as vllm-ascend v0.11.0's CPU offload connector does
(``distributed/cpu_offload_connector.py:263-264, 353-359, 413-429``); a device-to-host copy first waits for the
compute stream (the blocks were written by the step's kernels); a job is done when the event recorded after its
copies has completed. Emulated device: the same block pairs, one ``index_copy_`` per plane, done when it returns.

The handler also counts its finished jobs per direction (device blocks, bytes, tokens):
:meth:`HostOffloadHandler.take_counts` hands them to the ``host-offload-stats`` patch (``vllm:npu_kv_offload_*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from vllm_npu.interface import current_mode, get_logger

logger = get_logger(__name__)

#: What :meth:`HostOffloadHandler.take_counts` reports (host -> device is "loaded", device -> host "stored").
COUNTS = ("loaded_blocks", "loaded_bytes", "loaded_tokens", "stored_blocks", "stored_bytes", "stored_tokens")


def cache_planes(cache: torch.Tensor, kv_lora_rank: int | None) -> list[torch.Tensor]:
    """A layer's cache as planes ``[num_blocks, ...]`` (contiguous views): K and V of a GQA cache
    ``(2, nb, bs, heads, head)``; the latent and rope planes of an MLA cache ``(nb, bs, L + R)`` (one buffer, latent
    first, as npu-attention lays it out); any other cache as itself."""
    if cache.dim() == 5 and cache.shape[0] == 2:
        return [cache[0], cache[1]]
    if cache.dim() == 3 and kv_lora_rank is not None and 0 < kv_lora_rank < cache.shape[-1]:
        nb, bs, width = cache.shape
        flat = cache.reshape(-1)
        split = nb * bs * kv_lora_rank
        return [flat[:split].view(nb, bs * kv_lora_rank), flat[split:].view(nb, bs * (width - kv_lora_rank))]
    return [cache]


def block_pairs(src_blocks: np.ndarray, src_factor: int, dst_blocks: np.ndarray, dst_factor: int) -> np.ndarray:
    """``[n, 2]`` (source, destination) device-block-sized pairs, as vLLM's handler builds them: a block of the
    larger side is ``factor`` device blocks, and a partial first destination block skips its leading sub-blocks."""
    from vllm.v1.kv_offload.worker.cpu_gpu import expand_block_ids

    skip = -src_blocks.size % dst_factor
    count = src_blocks.size * src_factor
    if count != dst_blocks.size * dst_factor - skip:
        raise ValueError(f"{count} source sub-blocks for {dst_blocks.size * dst_factor - skip} destination ones")
    pairs = np.empty((count, 2), dtype=np.int64)
    expand_block_ids(src_blocks, src_factor, pairs[:, 0])
    expand_block_ids(dst_blocks, dst_factor, pairs[:, 1], skip_count=skip)
    return pairs


class HostOffloadHandler:
    """vLLM's ``OffloadingHandler`` (both directions) between the device caches and host memory."""

    def __init__(
        self,
        gpu_caches: dict[str, torch.Tensor],
        gpu_block_size: int,
        cpu_block_size: int,
        num_cpu_blocks: int,
        kv_lora_rank: int | None,
    ) -> None:
        from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec

        self._gpu_spec, self._cpu_spec = GPULoadStoreSpec, CPULoadStoreSpec
        if cpu_block_size % gpu_block_size:
            raise ValueError(f"offloaded block size {cpu_block_size} is not a multiple of {gpu_block_size}")
        self.factor = cpu_block_size // gpu_block_size
        mode = current_mode()
        self.npu = mode is not None and mode.value == "npu"
        self.device_planes: list[torch.Tensor] = []
        self.host_planes: list[torch.Tensor] = []
        seen: set[int] = set()
        for cache in gpu_caches.values():
            if cache.data_ptr() in seen:
                continue  # layers sharing one cache
            seen.add(cache.data_ptr())
            for plane in cache_planes(cache, kv_lora_rank):
                shape = (num_cpu_blocks * self.factor, *plane.shape[1:])
                self.device_planes.append(plane)
                self.host_planes.append(torch.zeros(shape, dtype=plane.dtype, device="cpu", pin_memory=self.npu))
        nbytes = sum(p.nbytes for p in self.host_planes)
        logger.info("host KV offload: %d planes, %.1f MiB of host memory", len(self.host_planes), nbytes / 2**20)
        self.gpu_block_size = gpu_block_size
        self.block_bytes = sum(p[0].nbytes for p in self.device_planes)  # one device block, every plane
        self._done: list[int] = []
        self._events: dict[int, Any] = {}
        self._jobs: dict[int, tuple[bool, int]] = {}  # job -> (to host, device blocks), until it finishes
        self._counts = dict.fromkeys(COUNTS, 0)
        if self.npu:
            self.d2h_stream = torch.npu.Stream()  # type: ignore[attr-defined]
            self.h2d_stream = torch.npu.Stream()  # type: ignore[attr-defined]

    def transfer_async(self, job_id: int, spec: tuple[Any, Any]) -> bool:
        src, dst = spec
        if isinstance(src, self._cpu_spec):
            assert isinstance(dst, self._gpu_spec)
            pairs = block_pairs(src.block_ids, self.factor, dst.block_ids, 1)
            srcs, dsts, to_host = self.host_planes, self.device_planes, False
        else:
            assert isinstance(src, self._gpu_spec) and isinstance(dst, self._cpu_spec)
            pairs = block_pairs(src.block_ids, 1, dst.block_ids, self.factor)
            srcs, dsts, to_host = self.device_planes, self.host_planes, True
        self._jobs[job_id] = (to_host, len(pairs))
        if self.npu:
            self._events[job_id] = self._copy_npu(pairs, srcs, dsts, to_host)
        else:
            s_idx, d_idx = torch.from_numpy(pairs[:, 0].copy()), torch.from_numpy(pairs[:, 1].copy())
            for s, d in zip(srcs, dsts):
                d.index_copy_(0, d_idx.to(d.device), s.index_select(0, s_idx.to(s.device)).to(d.device))
            self._done.append(job_id)
        return True

    def _copy_npu(self, pairs: np.ndarray, srcs: list[torch.Tensor], dsts: list[torch.Tensor], to_host: bool) -> Any:
        stream = self.d2h_stream if to_host else self.h2d_stream
        if to_host:
            stream.wait_stream(torch.npu.current_stream())  # type: ignore[attr-defined]
        event = torch.npu.Event()  # type: ignore[attr-defined]
        with torch.npu.stream(stream):  # type: ignore[attr-defined]
            for s_id, d_id in pairs.tolist():
                for s, d in zip(srcs, dsts):
                    d[d_id].copy_(s[s_id], non_blocking=True)
            event.record(stream)
        return event

    def get_finished(self) -> list[tuple[int, bool]]:
        done = [(job, True) for job in self._done]
        self._done = []
        for job, event in list(self._events.items()):
            if event.query():
                done.append((job, True))
                del self._events[job]
        for job, _ in done:
            to_host, blocks = self._jobs.pop(job)
            side = "stored" if to_host else "loaded"
            self._counts[f"{side}_blocks"] += blocks
            self._counts[f"{side}_bytes"] += blocks * self.block_bytes
            self._counts[f"{side}_tokens"] += blocks * self.gpu_block_size
        return done

    def take_counts(self) -> dict[str, int]:
        """The finished jobs' totals since the last call (:data:`COUNTS`: device blocks of ``gpu_block_size`` tokens,
        bytes over every cache plane, tokens; ``loaded_*`` = host to device = offload hits), then zeroed."""
        counts, self._counts = self._counts, dict.fromkeys(COUNTS, 0)
        return counts


def make_replacement(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """Build ``CPUOffloadingSpec.get_handlers``: vLLM's on CUDA, :class:`HostOffloadHandler` elsewhere."""

    def get_handlers(self: Any, kv_caches: dict[str, torch.Tensor]) -> Iterator[Any]:
        from vllm.platforms import current_platform

        if current_platform.is_cuda():
            yield from original(self, kv_caches)
            return
        from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec

        if getattr(self, "_handler", None) is None:
            mc = self.vllm_config.model_config
            kv_lora_rank = getattr(mc.hf_text_config, "kv_lora_rank", None) if mc.use_mla else None
            self._handler = HostOffloadHandler(
                kv_caches, self.gpu_block_size, self.offloaded_block_size, self.num_cpu_blocks, kv_lora_rank
            )
        yield GPULoadStoreSpec, CPULoadStoreSpec, self._handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self._handler

    get_handlers.__module__ = original.__module__
    get_handlers.__qualname__ = original.__qualname__
    get_handlers.__wrapped__ = original  # type: ignore[attr-defined]
    return get_handlers
