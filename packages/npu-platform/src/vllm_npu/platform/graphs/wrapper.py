# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUGraphWrapper: vLLM's static-graph wrapper on the NPU (ACL graphs) and on the emulated device (the twin).

vLLM builds one wrapper per piecewise FX piece (``get_static_graph_wrapper_cls``, runtime mode PIECEWISE) and, for
FULL_DECODE_ONLY, one around the whole model (the model runner's ``load_model``; runtime mode FULL). Each call reads
vLLM's forward context: a runtime mode other than the wrapper's runs the runnable eagerly; otherwise the batch
descriptor selects the graph, which is captured on first use (only while vLLM allows capturing) and replayed after.

It subclasses vLLM's ``CUDAGraphWrapper`` so every ``isinstance`` check of vLLM (``get_model``'s unwrap...) holds;
capture and replay go through the platform's device backend instead of ``torch.cuda``. Differences on purpose:

- input addresses are checked on every replay, not only under ``VLLM_LOGGING_LEVEL=DEBUG``, and so are those of the
  tensors the graph captured by reference (weights, buffers, KV caches, task arguments; :mod:`._reads`): a moved
  buffer would make an NPU graph read stale or freed memory; the check costs one ``data_ptr`` per tensor;
- before a replay, the graph's updatable tasks (decode attention kernels) are refreshed with the current step's host
  parameters (:mod:`vllm_npu.interface.graphs`);
- on the emulated device with ``npu.emulated_compile=inductor``, each captured graph is compiled right after its
  capture (:mod:`.emulated.twin_compile`), its compiled pieces kept in an on-disk cache (:mod:`.emulated.twin_pieces`).

Captures are counted in vLLM's ``compilation_counter.num_cudagraph_captured`` (as vLLM's wrapper does), replays in
:data:`GRAPH_STATS`.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast
from unittest.mock import patch

from vllm.compilation.counter import compilation_counter
from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphOptions, CUDAGraphWrapper
from vllm.compilation.monitor import validate_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import get_forward_context
from vllm_npu.interface import get_logger

from .._device import device_backend

if TYPE_CHECKING:
    from .compile_cache import CompileCache

logger = get_logger(__name__)


@dataclass
class PieceStats:
    """Per-process counts of the emulated twin's compiled pure pieces (:mod:`.emulated.twin_pieces` counts them;
    here so that every device's graph counts read them without importing the emulated twin)."""

    pieces: int = 0  # pure pieces placed in compiled graphs
    compiles: int = 0  # inductor compiles run (distinct pieces not found in this process)
    shared: int = 0  # pieces served by a function compiled for an identical earlier piece in this process
    disk_hits: int = 0  # compiles served from the on-disk cache's artifacts (no lowering)
    disk_writes: int = 0  # artifacts written to the on-disk cache
    reasons: Counter[str] = field(default_factory=Counter)  # why a compile could not be cached on disk

    def reset(self) -> None:
        self.pieces = self.compiles = self.shared = self.disk_hits = self.disk_writes = 0
        self.reasons.clear()

    def snapshot(self) -> dict[str, Any]:
        return {
            "pieces": self.pieces,
            "compiles": self.compiles,
            "shared": self.shared,
            "disk_hits": self.disk_hits,
            "disk_writes": self.disk_writes,
            "uncached": dict(self.reasons),
        }


PIECE_STATS = PieceStats()


@dataclass
class GraphStats:
    """Per-process graph counts (captures are also in vLLM's compilation_counter)."""

    captures: Counter[str] = field(default_factory=Counter)  # runtime mode name -> graphs captured
    replays: Counter[str] = field(default_factory=Counter)  # runtime mode name -> graph replays
    tasks: int = 0  # updatable kernels captured inside graphs
    # per captured batch size (tokens): seconds spent capturing, device memory taken (free-memory delta, bytes)
    capture_seconds: dict[int, float] = field(default_factory=dict)
    capture_bytes: Counter[int] = field(default_factory=Counter)
    # emulated device, npu.emulated_compile=inductor: graphs compiled per runtime mode, compile seconds per size
    # (part of capture_seconds); the snapshot adds the compiled pieces' counts (PIECE_STATS)
    compiled: Counter[str] = field(default_factory=Counter)
    compile_seconds: dict[int, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.captures.clear()
        self.replays.clear()
        self.tasks = 0
        self.capture_seconds.clear()
        self.capture_bytes.clear()
        self.compiled.clear()
        self.compile_seconds.clear()
        PIECE_STATS.reset()

    def snapshot(self) -> dict[str, Any]:
        return {
            "captures": dict(self.captures),
            "replays": dict(self.replays),
            "tasks": self.tasks,
            "capture_seconds": dict(self.capture_seconds),
            "capture_bytes": dict(self.capture_bytes),
            "compiled": dict(self.compiled),
            "compile_seconds": dict(self.compile_seconds),
            "pieces": PIECE_STATS.snapshot(),
        }


#: This process's counts since its model runner was built (the runner resets them: one engine per process).
GRAPH_STATS = GraphStats()

#: Every live graph wrapper of this process (NPUGraphWrapper and the torchair mode's), so that the model runner can
#: drop every captured graph of its engine (sleep mode: :meth:`.model_runner.NPUModelRunner.release_graphs`); vLLM
#: keeps the piecewise wrappers inside its compiled split graph, where the runner cannot reach them.
_LIVE_WRAPPERS: weakref.WeakSet[CUDAGraphWrapper] = weakref.WeakSet()


def register_wrapper(wrapper: CUDAGraphWrapper) -> None:
    _LIVE_WRAPPERS.add(wrapper)


def engine_wrappers(vllm_config: VllmConfig) -> list[CUDAGraphWrapper]:
    """The live graph wrappers built for ``vllm_config`` (one engine's)."""
    return [w for w in list(_LIVE_WRAPPERS) if w.vllm_config is vllm_config]


def _emulated_compile(vllm_config: VllmConfig) -> str:
    from vllm_npu.interface import AdditionalConfig

    # The platform refused a non-object --additional-config when it checked the config.
    extra = vllm_config.additional_config
    return AdditionalConfig.from_vllm(extra if isinstance(extra, Mapping) else None).emulated_compile


def _twin_compile_cache(vllm_config: VllmConfig) -> CompileCache | None:
    """The on-disk cache of compiled twin pieces (``<VLLM_NPU_CACHE_DIR>/emulated_compile``), None when vLLM's own
    compile cache is turned off (``VLLM_DISABLE_COMPILE_CACHE=1``)."""
    import vllm.envs as envs
    from vllm_npu.interface import AdditionalConfig

    from .compile_cache import EMULATED_COMPILE_SUBDIR, default_cache_root, worker_cache

    if envs.VLLM_DISABLE_COMPILE_CACHE:
        return None
    extra = vllm_config.additional_config
    kernels = AdditionalConfig.from_vllm(extra if isinstance(extra, Mapping) else None).kernels
    root = default_cache_root(EMULATED_COMPILE_SUBDIR)
    return worker_cache(vllm_config, root, device_type="emulated", kernels=kernels)


class NPUGraphWrapper(CUDAGraphWrapper):
    def __init__(
        self,
        runnable: Callable[..., Any],
        vllm_config: VllmConfig,
        runtime_mode: CUDAGraphMode,
        cudagraph_options: CUDAGraphOptions | None = None,
    ) -> None:
        super().__init__(runnable, vllm_config, runtime_mode, cudagraph_options)
        self.device_backend = device_backend()
        self.compile_captures = self.device_backend.type != "npu" and _emulated_compile(vllm_config) == "inductor"
        self.compile_cache = _twin_compile_cache(vllm_config) if self.compile_captures else None
        register_wrapper(self)

    def reset_graphs(self) -> int:
        """Release every captured graph (``reset()``: an ACL graph gives its memory back to the pool); the next call
        of each size captures again (only while vLLM allows capturing). Returns how many were released."""
        entries = list(self.concrete_cudagraph_entries.values())
        for entry in entries:
            cast(Any, entry.cudagraph).reset()
        self.concrete_cudagraph_entries.clear()
        return len(entries)

    def _capture_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if self.cudagraph_options.gc_disable:
            # Piecewise capture makes one graph per piece; collecting garbage before each (torch.npu.graph does)
            # makes capture slow. vLLM's CUDA wrapper does the same for all pieces but the first.
            stack.enter_context(patch("gc.collect", lambda: None))
            if self.device_backend.type == "npu":
                stack.enter_context(patch("torch.npu.empty_cache", lambda: None))
        return stack

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward_context = get_forward_context()
        mode = forward_context.cudagraph_runtime_mode
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        key = forward_context.batch_descriptor
        # vLLM's dispatcher returns a descriptor with every mode but NONE (and _dummy_run forces a mode only when it
        # agrees with the dispatcher), so a graph-mode step always has one.
        assert key is not None, f"{self.runtime_mode.name} graph step without a batch descriptor"
        entry = self.concrete_cudagraph_entries.get(key)
        if entry is None:
            validate_cudagraph_capturing_enabled()
            if self.cudagraph_options.debug_log_enable:
                logger.debug("capturing a static graph for (%s, %s)", self.runtime_mode.name, key)
            free_before = self.device_backend.mem_get_info()[0]
            start = time.perf_counter()
            with self._capture_context():
                graph = self.device_backend.capture_graph(self.runnable, args, kwargs, self.graph_pool, None)
            size = key.num_tokens
            if self.compile_captures:
                compile_start = time.perf_counter()
                graph.compile(self.compile_cache)
                GRAPH_STATS.compile_seconds[size] = (
                    GRAPH_STATS.compile_seconds.get(size, 0.0) + time.perf_counter() - compile_start
                )
                GRAPH_STATS.compiled[self.runtime_mode.name] += 1
            GRAPH_STATS.capture_seconds[size] = GRAPH_STATS.capture_seconds.get(size, 0.0) + time.perf_counter() - start
            GRAPH_STATS.capture_bytes[size] += max(0, free_before - self.device_backend.mem_get_info()[0])
            output = graph.output
            if self.device_backend.type == "npu":
                graph.weaken_output()  # the graph pool owns the output memory (as in vLLM's CUDA wrapper)
            self.concrete_cudagraph_entries[key] = CUDAGraphEntry(
                batch_descriptor=key, cudagraph=graph, output=graph.output
            )
            compilation_counter.num_cudagraph_captured += 1
            GRAPH_STATS.captures[self.runtime_mode.name] += 1
            GRAPH_STATS.tasks += graph.num_tasks
            return output
        # vLLM types the entry's graph as torch.cuda.CUDAGraph; ours holds the device backend's (NPUGraph, EmulatedGraph).
        graph = cast(Any, entry.cudagraph)
        self.refresh(graph)
        output = graph.replay(args, kwargs)
        GRAPH_STATS.replays[self.runtime_mode.name] += 1
        return output

    @staticmethod
    def refresh(graph: Any) -> None:
        """Update the graph's in-graph kernel parameters for this step (a seam tests replace to prove it matters)."""
        graph.refresh_tasks()
