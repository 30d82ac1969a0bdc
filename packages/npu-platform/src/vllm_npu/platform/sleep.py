# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Sleep mode without CUDA's ``CuMemAllocator``: :class:`SleepState`, what ``NPUWorker.sleep`` / ``wake_up`` run.

Device memory is released by shrinking the storages of the weights and the KV cache to zero bytes (every view and
every reference vLLM holds stays valid) and regrown on wake-up. Level 1 keeps a host copy of the weights; level 2
drops them and reloads them from the checkpoint. Regrown storages have new device addresses, so every static graph
is dropped at ``sleep`` and captured (torchair: compiled) again once ``wake_up`` has restored both weights and KV
cache.

Sleep mode and graphs. A captured ACL graph (PIECEWISE, FULL_DECODE_ONLY) embeds the device address of every
weight and KV-cache tensor its kernels read, and a torchair graph compiled with ``frozen_parameter=True`` binds every
parameter's address at its first run; after a wake-up that moved them, replaying those graphs would read freed
memory. Two ways out:

- keep the addresses, as vllm-ascend v0.11.0 does (``device_allocator/camem.py``): allocate weights and KV caches
  through ``torch.npu.memory.NPUPluggableAllocator`` + ``MemPool`` + ``use_mem_pool`` (torch_npu 2.8.0
  ``npu/memory.py``), with malloc/free functions that reserve virtual addresses and map physical memory
  (``aclrtReserveMemAddress`` / ``aclrtMallocPhysical`` / ``aclrtMapMem``), and unmap/re-map at the same virtual
  address on sleep/wake-up. torch_npu 2.8.0 exposes no Python API for those ACL calls: ``NPUPluggableAllocator``
  takes the path of a compiled shared library and the names of its C functions, which vllm-ascend builds as its
  own C extension (``vllm_ascend_C``, only with ``COMPILE_CUSTOM_KERNELS=1``). This plugin ships no C extension
  (pure-Python wheels, built and tested without CANN), so that way is not open here.
- re-capture after wake-up (what this module does): ``sleep`` releases every graph of the engine
  (:meth:`.model_runner.NPUModelRunner.release_graphs`: each wrapper's captured entries ``reset()``, each torchair
  compiled size forgotten), so the graph pool's memory is released with the rest; ``wake_up`` re-runs vLLM's
  capture loop (:meth:`~.model_runner.NPUModelRunner.recapture_graphs`) once no tag is asleep any more. Cost: one
  capture as at start-up (one warm-up forward plus one captured forward per capture size; torchair: one Dynamo
  trace per size, loaded from the compile cache when it is on, and GE's compile of each graph at its first run).
  Buffers (rotary caches...) are never released, so level 2 loses none of them (vllm-ascend backs up
  ``named_buffers()`` at level 2 because its "weights" pool holds everything allocated while loading).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from vllm_npu.interface import get_logger

from ._device import DeviceBackend

logger = get_logger(__name__)

GiB = 1 << 30
#: What sleep releases and wake_up restores, in this order.
SLEEP_TAGS = ("weights", "kv_cache")


class SleepingRunner(Protocol):
    """The model runner surface sleep mode uses (:class:`.model_runner.NPUModelRunner`)."""

    kv_caches: list[Any]

    def get_model(self) -> torch.nn.Module: ...

    def release_graphs(self) -> int: ...

    def recapture_graphs(self) -> int: ...

    def reload_weights(self) -> None: ...


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    """Each distinct non-empty storage behind ``tensors`` (tied weights share one) with its size in bytes."""
    seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (storage, storage.nbytes())
    return list(seen.values())


def flatten_tensors(entries: object) -> Iterable[torch.Tensor]:
    """Every tensor in arbitrarily nested lists/tuples (KV caches: a tensor, a list per virtual engine, a tuple of
    Mamba states); anything else is skipped."""
    if isinstance(entries, torch.Tensor):
        yield entries
    elif isinstance(entries, (list, tuple)):
        for entry in entries:
            yield from flatten_tensors(entry)


def tensors_of(runner: SleepingRunner, forward_context: Mapping[str, Any], tag: str) -> Iterable[torch.Tensor]:
    """The tensors of ``tag``: the model's parameters (``"weights"``) or every KV-cache tensor (``"kv_cache"``).

    For the KV cache, the runner's list (one cache per layer index) first, then every layer's bound cache from vLLM's
    ``static_forward_context``: a decoder layer may hold several cache layers (DeepSeek-V3.2's indexer keys);
    :func:`unique_storages` drops the repeats."""
    if tag == "weights":
        return runner.get_model().parameters()
    kv: list[object] = list(runner.kv_caches)
    kv += [getattr(layer, "kv_cache", None) for layer in forward_context.values()]
    return list(flatten_tensors(kv))


class SleepState:
    """One worker's released memory: storages shrunk per tag, the level-1 host copy of the weights, and whether the
    engine's graphs were dropped (and must be captured again once every tag is awake)."""

    def __init__(self) -> None:
        self.released: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        self.weights_host_copy: list[torch.UntypedStorage] = []
        self.graphs_released = False

    def sleeping_bytes(self) -> dict[str, int]:
        """Bytes released and not yet woken up, per tag."""
        return {tag: sum(n for _, n in storages) for tag, storages in self.released.items()}

    def sleep(
        self,
        runner: SleepingRunner,
        forward_context: Mapping[str, Any],
        backend: type[DeviceBackend],
        device: torch.device | None,
        level: int,
    ) -> None:
        """Release device memory. Level 1: weights moved to host memory, KV cache discarded. Level 2: both
        discarded (weights are reloaded from the checkpoint on wake-up)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.released:
            logger.warning("NPUWorker is already sleeping")
            return
        free_before, _ = backend.mem_get_info(device)
        # Graphs read the weights and KV caches at their current addresses, which wake-up changes (module docstring).
        self.graphs_released = runner.release_graphs() > 0 or self.graphs_released
        for tag in SLEEP_TAGS:
            storages = unique_storages(tensors_of(runner, forward_context, tag))
            if tag == "weights" and level == 1:
                self.weights_host_copy = [
                    torch.UntypedStorage(nbytes, device="cpu").copy_(storage) for storage, nbytes in storages
                ]
            for storage, _ in storages:
                storage.resize_(0)
            self.released[tag] = storages
        gc.collect()
        backend.empty_cache()
        free_after, total = backend.mem_get_info(device)
        logger.info(
            "sleep level %d released %.3f GiB (%.3f GiB still in use)",
            level,
            max(0, free_after - free_before) / GiB,
            (total - free_after) / GiB,
        )

    def wake_up(
        self, runner: SleepingRunner, backend: type[DeviceBackend], device: torch.device | None, tags: list[str] | None
    ) -> None:
        """Re-allocate the released memory of ``tags`` (None: all): KV cache zeroed, weights restored. Once no tag is
        asleep, the graphs released by :meth:`sleep` are captured again (they must see the new addresses)."""
        for tag in tags or list(SLEEP_TAGS):
            if tag not in SLEEP_TAGS:
                raise ValueError(f"unknown sleep tag {tag!r}; expected one of {SLEEP_TAGS}")
            storages = self.released.pop(tag, None)
            if storages is None:
                continue
            for storage, nbytes in storages:
                storage.resize_(nbytes)
            if tag == "kv_cache":
                for storage, _ in storages:
                    storage.fill_(0)  # type: ignore[attr-defined]  # a real method that torch's stubs omit
            elif self.weights_host_copy:
                for (storage, _), host in zip(storages, self.weights_host_copy, strict=True):
                    storage.copy_(host)
                self.weights_host_copy = []
            else:
                runner.reload_weights()
        backend.synchronize(device)
        if self.graphs_released and not self.released:
            runner.recapture_graphs()
            self.graphs_released = False
