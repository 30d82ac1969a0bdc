# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Device facts and runtime calls of the two device modes, behind one small interface.

Everything above this module (platform, worker, model runner, communicator) is shared between the NPU and the
emulated device; only the answers below differ:

- :class:`NPUDevice` maps every call to ``torch.npu`` (importing ``torch_npu`` on first use, never at module import,
  because importing it without CANN breaks ``import torch``).
- :class:`EmulatedDevice` is the CPU: synchronisation and streams are no-ops (CPU ops complete in order), memory is
  the process's resident set and the host's RAM. Its streams keep a bounded log of the stream calls made through
  its stream API (``wait_stream`` / ``wait_event``, entering and leaving ``stream(s)``), and ``current_stream``
  follows ``stream(s)`` blocks, so tests can check the order a multi-stream feature intends.

Both devices keep torch_npu's per-process runtime rule. The emulated device keeps it itself
(:data:`EMULATED_RUNTIME`): the calls for which torch_npu 2.8.0 runs ``_lazy_init()`` initialise the emulated runtime
of the process, and in a child forked from a process that had initialised it the first such call raises, as
torch_npu does (``torch_npu/npu/__init__.py:222-270``). So a front-end that touches the runtime before vLLM forks its
engine core or workers fails in CI as it would on an Ascend host.

Memory numbers are bytes. ``device`` arguments accept anything ``torch.device`` accepts, or None (current device).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch


@functools.lru_cache(maxsize=1)
def _torch_npu() -> Any:
    """``torch.npu`` after importing ``torch_npu`` (which registers the ``npu`` device with torch), configured once
    per process (the first device call, before any model weight exists)."""
    import torch_npu  # noqa: F401  (registers torch.npu)

    # Internal (private) formats such as FRACTAL_NZ off, explicitly: its default differs by chip and torch_npu build
    # (documented True on A2 and False on A3; later 2.8.0 builds changed A2). Every tensor the plugin hands a kernel
    # is ND — float weights stay ND as in vllm-ascend v0.11.0, KV caches are ND, and every kernel contract, reference
    # twin and test fake models ND — so a private format could only appear by accident, where a later .view/.T of it
    # (vLLM's MLA kv_b_proj split) would read blocked storage as row-major. vllm-ascend sets True because it casts
    # quantized and MoE weights to NZ for speed; this plugin does not (an NZ cast would be a no-op here).
    # The Ascend 310P is the exception: its attention kernels take FRACTAL_NZ masks, which npu_format_cast(..., 29)
    # tags only with internal formats allowed (vllm-ascend v0.11.0 allows them on every chip, and on 310P casts the
    # masks, attention/attention_v1.py:347-357); nothing else casts to NZ there (ops/attention_310p.py).
    from vllm_npu.interface import is_310p

    npu: Any = torch.npu  # type: ignore[attr-defined]  # registered at runtime by torch_npu
    npu.config.allow_internal_format = is_310p()
    return npu


#: What a forked child's first runtime call raises; the meaning of torch_npu 2.8.0's own message
#: (``torch_npu/npu/__init__.py:246-249``, in ``_lazy_init`` when ``_is_internal_in_bad_fork``).
FORK_ERROR = (
    "the NPU runtime cannot be re-initialised in a forked subprocess: its parent had initialised it before the "
    "fork; start NPU worker processes with the 'spawn' method (VLLM_WORKER_MULTIPROC_METHOD=spawn)"
)


class DeviceRuntimeState:
    """One process's device-runtime state, with torch_npu 2.8.0's fork rule (``torch_npu/npu/__init__.py``):

    - ``lazy_init()`` is what torch_npu runs before a runtime call (``_lazy_init``, lines 222-262): the first call
      initialises the runtime of this process; in a child forked from a process that had initialised it, the first
      call raises :data:`FORK_ERROR` instead (lines 246-249);
    - ``after_fork_in_child()`` is torch_npu's ``_after_fork`` hook (lines 265-273): an initialised state whose pid
      is not the child's becomes a bad fork. Registered, as torch_npu registers it, with
      ``multiprocessing.util.register_after_fork`` (line 131): it runs in children that ``multiprocessing`` forks
      (vLLM's engine core and workers), not after a bare ``os.fork()``.
    """

    def __init__(self) -> None:
        self._initialized = False
        self._bad_fork = False
        self._pid: int | None = None
        self._lock = threading.Lock()
        #: The runtime calls made while the runtime was not initialised (the one that initialised it, or those that
        #: raised in a bad fork), oldest first; calls after initialisation cost one attribute check and are not kept.
        self.calls: collections.deque[str] = collections.deque(maxlen=256)

    @property
    def initialized(self) -> bool:
        """``torch.npu.is_initialized()``: initialised in this process (False in a bad fork)."""
        return self._initialized and not self._bad_fork

    @property
    def in_bad_fork(self) -> bool:
        return self._bad_fork

    def lazy_init(self, call: str) -> None:
        """Run before the runtime call ``call``: initialise this process's runtime, or raise in a bad fork."""
        if self._initialized:
            return
        self.calls.append(call)
        with self._lock:  # double-checked, as torch_npu: another thread may have initialised meanwhile
            self._init_locked(call)

    def _init_locked(self, call: str) -> None:
        if self._initialized:
            return
        if self._bad_fork:
            raise RuntimeError(f"{FORK_ERROR} (first runtime call in this process: {call})")
        self._pid = os.getpid()
        self._initialized = True

    def after_fork_in_child(self) -> None:
        if self._initialized and self._pid != os.getpid():
            self._initialized = False
            self._bad_fork = True
        self._lock = threading.Lock()  # a lock held by another thread at fork time stays held in the child


#: The emulated device's runtime state of this process.
EMULATED_RUNTIME = DeviceRuntimeState()
multiprocessing.util.register_after_fork(EMULATED_RUNTIME, DeviceRuntimeState.after_fork_in_child)


def npu_runtime_initialized() -> bool:
    """Whether torch_npu's runtime is initialised in this process, without importing torch_npu (False when it was
    never imported: then nothing initialised the runtime)."""
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return False
    return bool(torch_npu.npu.is_initialized())


class _NoopEvent:
    """A completed event: CPU work is done when the call returns, so record/wait/synchronize have nothing to do."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


#: The emulated streams' log: ``(call, stream id, other stream id or None)`` tuples, oldest first, bounded (a
#: recorder, not state anything reads back to compute with). Stream 0 is the default stream.
STREAM_LOG: collections.deque[tuple[str, int, int | None]] = collections.deque(maxlen=4096)
_stream_ids = itertools.count(1)
_current = threading.local()


class _NoopStream:
    """An in-order CPU "stream" (all of them run in program order; each has an ``id`` for the log)."""

    def __init__(self, device: Any = None, *args: Any, **kwargs: Any) -> None:
        if device is not None:
            EMULATED_RUNTIME.lazy_init("Stream")
        self.id = next(_stream_ids)

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        STREAM_LOG.append(("wait_stream", self.id, getattr(stream, "id", None)))

    def wait_event(self, event: Any) -> None:
        STREAM_LOG.append(("wait_event", self.id, None))

    def record_event(self, event: Any = None) -> _NoopEvent:
        return event if event is not None else _NoopEvent()

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoopStream)

    def __hash__(self) -> int:
        return 0


_CPU_STREAM = _NoopStream()
_CPU_STREAM.id = 0


class DeviceBackend:
    """The interface both device modes implement (all static: a device mode is process-wide)."""

    #: torch device type of tensors on this device ("npu" or "cpu").
    type: ClassVar[str]

    @staticmethod
    def runtime_initialized() -> bool:
        """Whether this process has initialised the device runtime (``torch.npu.is_initialized()``)."""
        raise NotImplementedError

    @staticmethod
    def torch_device(local_rank: int) -> torch.device:
        raise NotImplementedError

    @staticmethod
    def set_device(device: torch.device) -> None:
        raise NotImplementedError

    @staticmethod
    def synchronize(device: Any = None) -> None:
        raise NotImplementedError

    @staticmethod
    def empty_cache() -> None:
        raise NotImplementedError

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        raise NotImplementedError

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        raise NotImplementedError

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        raise NotImplementedError

    @staticmethod
    def peak_memory_allocated(device: Any = None) -> int:
        raise NotImplementedError

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        raise NotImplementedError

    @staticmethod
    def current_memory_usage(device: Any = None) -> int:
        """Bytes in use now (what vLLM's ``DeviceMemoryProfiler`` diffs around weight loading)."""
        raise NotImplementedError

    @staticmethod
    def device_name(device_id: int = 0) -> str:
        raise NotImplementedError

    # Stream/event API in the shape of ``torch.cuda``'s, for the model runner's scoped shim.
    @staticmethod
    def stream_api() -> dict[str, Any]:
        """``{"Stream", "Event", "current_stream", "default_stream", "stream"}`` for this device."""
        raise NotImplementedError

    @staticmethod
    def soc() -> str:
        """The chip family: "A2" (Atlas A2, 910B), "A3" (Atlas A3, 910_93), "310P" (Atlas 300I, Ascend 310P), or ""
        (other, or not an NPU). On the NPU this initialises the runtime (``get_soc_version``): workers only; the
        front-end asks :func:`vllm_npu.interface.current_chip`, which does not."""
        return ""

    # Static graphs (see :mod:`.graphs`).
    @staticmethod
    def graph_pool_handle() -> Any:
        """The memory pool token graphs share (None where graphs have no separate pool)."""
        raise NotImplementedError

    @staticmethod
    def capture_graph(
        runnable: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], pool: Any, stream: Any
    ) -> Any:
        """Capture ``runnable(*args, **kwargs)`` into a static graph (``.output``, ``.replay(args, kwargs)``,
        ``.refresh_tasks()``, ``.num_tasks``, ``.reset()``)."""
        raise NotImplementedError


class NPUDevice(DeviceBackend):
    type = "npu"

    @staticmethod
    def runtime_initialized() -> bool:
        return npu_runtime_initialized()

    @staticmethod
    def torch_device(local_rank: int) -> torch.device:
        return torch.device(f"npu:{local_rank}")

    @staticmethod
    def set_device(device: torch.device) -> None:
        _torch_npu().set_device(device)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        _torch_npu().synchronize(device)

    @staticmethod
    def empty_cache() -> None:
        _torch_npu().empty_cache()

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        free, total = _torch_npu().mem_get_info(device)
        return int(free), int(total)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return int(_torch_npu().memory_allocated(device))

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return int(_torch_npu().memory_reserved(device))

    @staticmethod
    def peak_memory_allocated(device: Any = None) -> int:
        return int(_torch_npu().memory_stats(device).get("allocated_bytes.all.peak", 0))

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        _torch_npu().reset_peak_memory_stats(device)

    @staticmethod
    def current_memory_usage(device: Any = None) -> int:
        npu = _torch_npu()
        npu.reset_peak_memory_stats(device)
        return int(npu.max_memory_allocated(device))

    @staticmethod
    def device_name(device_id: int = 0) -> str:
        return str(_torch_npu().get_device_name(device_id))

    @staticmethod
    def soc() -> str:
        # torch_npu.npu.get_soc_version() codes (the wheel's NpuVariables.h SocVersion): 200-205 the Ascend 310P
        # family, 220-225 the 910B family (A2), 250-255 the 910_93 family (A3; A2/A3 as vllm-ascend v0.11.0's
        # utils.py:631-639 reads them).
        from vllm_npu.interface import chip_of_soc_version

        return chip_of_soc_version(int(_torch_npu().get_soc_version()))

    @staticmethod
    def stream_api() -> dict[str, Any]:
        npu = _torch_npu()
        return {
            "Stream": npu.Stream,
            "Event": npu.Event,
            "current_stream": npu.current_stream,
            "default_stream": npu.default_stream,
            "stream": npu.stream,
        }

    @staticmethod
    def graph_pool_handle() -> Any:
        from .graphs._npu import graph_pool_handle

        return graph_pool_handle()

    @staticmethod
    def capture_graph(
        runnable: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], pool: Any, stream: Any
    ) -> Any:
        from .graphs._npu import NPUGraph

        return NPUGraph.capture(runnable, args, kwargs, pool, stream)


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


@contextlib.contextmanager
def _noop_stream_context(stream: Any = None) -> Iterator[None]:
    """``stream(s)``: ``current_stream()`` is ``s`` inside the block (logged as enter / exit)."""
    if stream is None:
        yield
        return
    stack = _current.__dict__.setdefault("stack", [])
    stack.append(stream)
    STREAM_LOG.append(("enter", getattr(stream, "id", -1), None))
    try:
        yield
    finally:
        stack.pop()
        STREAM_LOG.append(("exit", getattr(stream, "id", -1), None))


def _emulated_current_stream(device: Any = None) -> Any:
    EMULATED_RUNTIME.lazy_init("current_stream")
    stack = _current.__dict__.get("stack")
    return stack[-1] if stack else _CPU_STREAM


def _emulated_default_stream(device: Any = None) -> Any:
    EMULATED_RUNTIME.lazy_init("default_stream")
    return _CPU_STREAM


class EmulatedDevice(DeviceBackend):
    """The CPU standing in for the NPU. Memory "allocated" is the process RSS: the emulated device shares the host's
    memory with everything else in the process, so there is no separate device pool to measure."""

    type = "cpu"

    # The calls below that torch_npu 2.8.0 runs ``_lazy_init()`` for start with ``EMULATED_RUNTIME.lazy_init``:
    # set_device (the C++ binding ``_npu_setDevice`` runs ``npu_lazy_init()``; the wheel's libtorch_npu.so calls
    # back into ``_lazy_init``), synchronize (npu/utils.py:70), mem_get_info (npu/__init__.py:463), current_stream
    # and default_stream (utils.py:266, 281) and Stream(device) (streams.py:25 -> ``device.__enter__``, utils.py:117).
    # empty_cache and the memory_stats family do nothing / return nothing before initialisation (memory.py:158, 246)
    # and get_device_name runs no _lazy_init (npu/__init__.py:442-446): they do not initialise here either.

    @staticmethod
    def runtime_initialized() -> bool:
        return EMULATED_RUNTIME.initialized

    @staticmethod
    def torch_device(local_rank: int) -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def set_device(device: torch.device) -> None:
        EMULATED_RUNTIME.lazy_init("set_device")  # one CPU device: nothing else to select

    @staticmethod
    def synchronize(device: Any = None) -> None:
        EMULATED_RUNTIME.lazy_init("synchronize")  # CPU kernels have finished when they return

    @staticmethod
    def empty_cache() -> None:
        pass  # no caching allocator on the CPU

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        import psutil

        EMULATED_RUNTIME.lazy_init("mem_get_info")
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return _rss_bytes()

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return _rss_bytes()

    @staticmethod
    def peak_memory_allocated(device: Any = None) -> int:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass  # the kernel's peak RSS cannot be reset

    @staticmethod
    def current_memory_usage(device: Any = None) -> int:
        return _rss_bytes()

    @staticmethod
    def device_name(device_id: int = 0) -> str:
        from vllm_npu.interface import current_chip

        chip = current_chip()
        return f"emulated NPU (CPU, as Ascend {chip})" if chip else "emulated NPU (CPU)"

    @staticmethod
    def soc() -> str:
        """``VLLM_NPU_EMULATED_SOC``'s chip ("" when unset): the emulated device takes that chip's paths."""
        from vllm_npu.interface import current_chip

        return current_chip()

    @staticmethod
    def stream_api() -> dict[str, Any]:
        return {
            "Stream": _NoopStream,
            "Event": _NoopEvent,
            "current_stream": _emulated_current_stream,
            "default_stream": _emulated_default_stream,
            "stream": _noop_stream_context,
        }

    @staticmethod
    def graph_pool_handle() -> Any:
        return None  # the twin's outputs are ordinary tensors; there is no device pool to share

    @staticmethod
    def capture_graph(
        runnable: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], pool: Any, stream: Any
    ) -> Any:
        from .graphs.emulated.twin import EmulatedGraph

        return EmulatedGraph.capture(runnable, args, kwargs)


def device_backend() -> type[DeviceBackend]:
    """The active platform's device backend (the emulated CPU when vLLM runs on another platform, e.g. in tests).

    The model runner, the worker and the graph wrappers all ask here, so :mod:`.graphs` never imports the model
    runner that builds its wrappers (``tests/test_layering.py`` keeps that edge out)."""
    from vllm.platforms import current_platform

    return getattr(current_platform, "device_backend", EmulatedDevice)


_STREAM_NAMES = ("Stream", "Event", "current_stream", "default_stream", "stream")
_shim_lock = threading.Lock()
_shim_state: dict[str, Any] = {"depth": 0, "saved": None}  # depth of active shims; real torch.cuda attributes


@contextlib.contextmanager
def cuda_stream_api_as(device: type[DeviceBackend]) -> Iterator[None]:
    """Within the block, ``torch.cuda.{Stream, Event, current_stream, default_stream, stream}`` are ``device``'s.

    vLLM's ``GPUModelRunner`` creates CUDA streams/events in ``__init__`` and, with async scheduling, in
    ``execute_model`` (``AsyncGPUModelRunnerOutput``). The model runner enters this context only around those two
    calls, so outside them the process (and other libraries) sees the real ``torch.cuda``. The real attributes are
    restored when the last active block exits (also when it raises); overlapping blocks on several threads are safe.
    """
    with _shim_lock:
        if _shim_state["depth"] == 0:
            _shim_state["saved"] = {name: getattr(torch.cuda, name) for name in _STREAM_NAMES}
            for name, value in device.stream_api().items():
                setattr(torch.cuda, name, value)
        _shim_state["depth"] += 1
    try:
        yield
    finally:
        with _shim_lock:
            _shim_state["depth"] -= 1
            if _shim_state["depth"] == 0:
                for name, value in _shim_state["saved"].items():
                    setattr(torch.cuda, name, value)
                _shim_state["saved"] = None


_sync_state: dict[str, Any] = {"depth": 0, "saved": None}  # depth of active synchronize shims; the real function


@contextlib.contextmanager
def cuda_synchronize_as(backend: type[DeviceBackend]) -> Iterator[None]:
    """Within the block, ``torch.cuda.synchronize(device=None)`` is ``backend.synchronize``.

    For vLLM code that synchronizes through ``torch.cuda`` unconditionally: its EPLB rearrangement
    (``EplbState.rearrange`` and ``rearrange_expert_weights_inplace`` in ``vllm/distributed/eplb/``), which the
    model runner's ``eplb_step`` runs inside this block. Restored as :func:`cuda_stream_api_as` restores its names.
    """
    with _shim_lock:
        if _sync_state["depth"] == 0:
            _sync_state["saved"] = torch.cuda.synchronize

            def synchronize(device: Any = None) -> None:
                backend.synchronize(device)

            torch.cuda.synchronize = synchronize
        _sync_state["depth"] += 1
    try:
        yield
    finally:
        with _shim_lock:
            _sync_state["depth"] -= 1
            if _sync_state["depth"] == 0:
                torch.cuda.synchronize = _sync_state["saved"]
                _sync_state["saved"] = None
