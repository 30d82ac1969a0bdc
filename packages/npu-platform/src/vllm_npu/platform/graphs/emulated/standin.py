# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The emulated device's stand-in for torchair's graph compiler: ``aot_eager`` with a real on-disk cache.

``torch.compile(..., backend=StandInBackend(...), fullgraph=True, dynamic=False)`` hands this backend Dynamo's FX
graph of one decode batch size. Without a cache (or on a miss) it does what torch's ``aot_eager`` backend does:
AOTAutograd lowers the graph to a functionalized aten graph (``keep_inference_input_mutations=True``, as an
inference compiler keeps them) which then runs as is. On an NPU, torchair's backend takes the same graph and
compiles it for the device; this backend is the host-side twin of that step.

The cache: the lowered aten forward graph is saved (its generated Python source and its tensor constants) under the cache key's directory, named
by the batch size and a digest of Dynamo's graph (its code and its inputs' shapes/dtypes/strides), so a different
trace never loads another trace's graph. On a hit the lowering is skipped: the loaded graph *is* what runs.

A lowered graph is saved only when running it bare is exactly what AOTAutograd's runtime wrappers would run: no
input mutations or metadata mutations outside the graph, no output aliasing an input or an intermediate, no effect
tokens, one graph input per Dynamo input (no de-duplicated or synthetic-base inputs). Otherwise the compile still
works, it is just not cached (counted in ``uncacheable``).

Frozen parameters: on an NPU the torchair mode compiles with ``frozen_parameter=True``, so GE binds every
``nn.Parameter`` input (and every input marked with ``torch._dynamo.mark_static_address``) to the device address it
had at the graph's first run (torch_npu 2.8.0 ``torchair/_ge_concrete_graph/graph_pass.py`` ``get_frozen_flag``:
``PARAMETER`` and ``STATIC_TENSOR`` inputs; ``fx2ge_converter.py`` warns that their addresses must stay the same for
the program's lifetime). Other inputs (buffers such as the rotary caches, the KV caches, which are marked with
``mark_static``, not a static address) are bound per run. The stand-in keeps that rule: it records the address of
every frozen input when it compiles (or loads) a graph and raises :class:`~.GraphInputMovedError` when a call hands
one at another address, where the NPU graph would read the memory the parameter had before (sleep mode moves the
weights; :meth:`.torchair.TorchairWrapper.reset_graphs` is how the engine recompiles after wake-up).

Counts go to the :class:`~.torchair.TorchairStats` passed in: ``lowerings`` (AOT traces), ``cache_hits``,
``cache_writes``, ``uncacheable``, and ``backend_seconds`` (time spent lowering or loading, per size).
"""

from __future__ import annotations

import hashlib
import os
import time
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm_npu.interface import get_logger

from .. import GraphInputMovedError

if TYPE_CHECKING:
    from ..compile_cache import CompileCache
    from ..torchair import TorchairStats

logger = get_logger(__name__)


def graph_digest(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    """sha256 of Dynamo's graph code and its inputs' metadata (what decides the lowered graph)."""
    digest = hashlib.sha256(gm.code.encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            digest.update(f"T{tuple(x.shape)}{x.stride()}{x.dtype}{x.device.type};".encode())
        else:
            digest.update(f"{type(x).__name__}:{x!r};".encode())
    return digest.hexdigest()


def _cacheable(fw: torch.fx.GraphModule, num_inputs: int) -> str | None:
    """None when ``fw`` can run without AOTAutograd's runtime wrappers, else the reason it cannot."""
    from torch._functorch._aot_autograd.schemas import OutputType, SubclassCreationMeta
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    if meta is None:
        return "no AOTAutograd metadata"
    placeholders = sum(1 for n in fw.graph.nodes if n.op == "placeholder")
    if placeholders != num_inputs:
        return f"{placeholders} graph inputs for {num_inputs} Dynamo inputs"
    if meta.num_mutated_inp_runtime_indices:
        return "input mutations outside the graph"
    if meta.tokens:
        return "effect tokens"
    if any(o.output_type != OutputType.non_alias for o in meta.output_info):
        return "an output aliases an input or an intermediate"
    if any(isinstance(m, SubclassCreationMeta) for m in meta.subclass_inp_meta):
        return "tensor-subclass inputs"
    return None


#: Version of the artifact layout written by :func:`save_graph`.
ARTIFACT_FORMAT = 1


def save_graph(fw: torch.fx.GraphModule, path: os.PathLike) -> str | None:
    """Write ``fw`` as its generated Python source plus its tensor constants; None, or why it cannot be saved.

    The source is what FX generated for the graph (``GraphModule.code`` with its import block), so loading needs no
    re-tracing (FX's own pickling re-traces the code symbolically, which higher-order ops such as
    ``auto_functionalized`` do not support).
    """
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer

    constants: dict[str, torch.Tensor] = {}
    for node in fw.graph.nodes:
        if node.op == "get_attr":
            value = getattr(fw, str(node.target), None) if "." not in str(node.target) else None
            if not isinstance(value, torch.Tensor):
                return f"graph attribute {node.target!r} is not a plain tensor constant"
            constants[str(node.target)] = value
    code = fw.graph.python_code(root_module="self")
    source = _format_import_block(code.globals, sys_importer) + code.src
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    torch.save({"format": ARTIFACT_FORMAT, "source": source, "constants": constants}, tmp)
    os.replace(tmp, path)
    return None


def load_graph(path: os.PathLike) -> Callable[..., Any]:
    """The graph :func:`save_graph` wrote, as a callable taking the graph's inputs."""
    data = torch.load(path, weights_only=True)
    if data.get("format") != ARTIFACT_FORMAT:
        raise RuntimeError(f"{path}: artifact format {data.get('format')!r}, expected {ARTIFACT_FORMAT}")
    namespace: dict[str, Any] = {}
    exec(compile(data["source"], f"<torchair cache {os.fspath(path)}>", "exec"), namespace)
    forward = namespace["forward"]
    holder = types.SimpleNamespace(**data["constants"])

    def run(*args: Any) -> Any:
        return forward(holder, *args)

    return run


def frozen_inputs(example_inputs: Sequence[Any]) -> list[tuple[int, int]]:
    """``(position, device address)`` of every input torchair freezes under ``frozen_parameter=True``: the
    ``nn.Parameter`` inputs and the static-address ones (``_dynamo_static_input_type == "guarded"``)."""
    return [
        (i, x.data_ptr())
        for i, x in enumerate(example_inputs)
        if isinstance(x, torch.Tensor)
        and (isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) == "guarded")
    ]


def with_frozen_addresses(compiled: Callable[..., Any], frozen: list[tuple[int, int]], size: int) -> Callable[..., Any]:
    """``compiled``, refusing a call whose frozen inputs (:func:`frozen_inputs`) moved since the compile."""

    def run(*args: Any) -> Any:
        for i, address in frozen:
            if args[i].data_ptr() != address:
                raise GraphInputMovedError(
                    f"torchair graph of batch size {size}: frozen parameter input {i} moved from {address:#x} to "
                    f"{args[i].data_ptr():#x}; with frozen_parameter=True the NPU graph would read the old address. "
                    "Recompile after moving weights (TorchairWrapper.reset_graphs, as the worker's wake_up does)"
                )
        return compiled(*args)

    return run


class StandInBackend:
    """A ``torch.compile`` backend for one batch size (see the module docstring)."""

    def __init__(self, batch_size: int, cache: CompileCache | None, stats: TorchairStats) -> None:
        self.batch_size = batch_size
        self.cache = cache
        self.stats = stats

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        try:
            return with_frozen_addresses(
                self._compile(gm, example_inputs), frozen_inputs(example_inputs), self.batch_size
            )
        finally:
            self.stats.backend_seconds[self.batch_size] = time.perf_counter() - start

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        path = None
        if self.cache is not None:
            path = self.cache.artifact(self.batch_size, graph_digest(gm, example_inputs))
            if path.exists():
                loaded = load_graph(path)
                self.stats.cache_hits += 1
                logger.debug("torchair stand-in: batch size %d loaded from %s", self.batch_size, path)
                return loaded
        return self._lower(gm, example_inputs, path)

    def _lower(self, gm: torch.fx.GraphModule, example_inputs: list[Any], path: os.PathLike | None) -> Any:
        from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

        num_inputs = len(example_inputs)

        def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
            fw = gm  # the parameter names are AOTDispatchCompiler's
            self.stats.lowerings += 1
            if path is not None:
                reason = _cacheable(fw, num_inputs) or save_graph(fw, path)
                if reason is None:
                    self.stats.cache_writes += 1
                else:
                    self.stats.uncacheable += 1
                    logger.info("torchair stand-in: batch size %d not cached: %s", self.batch_size, reason)
            return make_boxed_func(fw)

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler, keep_inference_input_mutations=True)
