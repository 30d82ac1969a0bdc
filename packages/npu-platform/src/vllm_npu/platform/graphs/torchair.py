# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The torchair mode (``--additional-config '{"npu": {"graph_mode": "torchair"}}'``): the decode forward compiled
per padded batch size, prefill and mixed steps eager.

How it plugs into vLLM: ``npu.graph_mode='torchair'`` runs vLLM's FULL_DECODE_ONLY dispatch (:mod:`.config`):
pure-decode batches are padded to a size of ``compilation_config.cudagraph_capture_sizes`` and reach the model with
runtime mode FULL and that size in the batch descriptor; every other batch runs with mode NONE. The model runner
puts :class:`TorchairWrapper` around the model where FULL_DECODE_ONLY puts its graph wrapper, and vLLM's capture
loop (warm-up, then one FULL call per size, largest first) is where each size is compiled.

What is compiled: the model's own ``forward`` (one code path: the same modules, attention and MoE stacks as eager),
through ``torch.compile(fullgraph=True)``, one compiled function per batch size, each calling ``forward`` from a code
object and name of its own (:func:`forward_for`; Dynamo keeps its cache per code object, so sizes never evict each
other and torchair's cache can key by name). Embedding, norms, RoPE and linear layers are traced by Dynamo, our
CustomOp overrides included, and so are MoE layers (unquantized, or npu-quant's quantized experts) whose dispatch
needs no host reads (npu-ops' ``AscendFusedMoE`` calls its ``forward_impl`` instead of vLLM's opaque ``moe_forward``
op in this mode); other MoE layers stay that opaque op.

Attention of GQA and MLA models is inside the graph (:func:`attention_in_graph`): the platform answers
``opaque_attention_op()`` False, so vLLM's attention layer calls the impl directly and Dynamo traces it. Before each
compiled step this wrapper has every attention metadata object of the step lay itself out for the padded batch
(:func:`vllm_npu.interface.protocols.graph_inputs_of`: block tables, sequence lengths and KV slots as fixed-shape
tensors, plus the lengths as a host list for the NPU kernel) and passes them to the compiled function as an
argument, which stores them where the impls read them (:data:`vllm_npu.interface.graphs.COMPILED_STEP`). So they are
graph *inputs*, guarded on shapes only: per-step values are neither baked in nor recompiled for. (Read from vLLM's
forward context, a module global, Dynamo would bake the Python ints in as constants even with dynamic shapes.)
DeepSeek-V3.2's sparse attention (SFA) keeps vLLM's opaque attention op (registered with a fake implementation): one
node in the graph that reads the step's metadata from the forward context when it runs, which the stand-in backend
can run and GE cannot convert (the torchair mode is refused for SFA on an NPU).

Backends: on an NPU torchair's (:mod:`._torchair_npu`: ``dynamic=True`` with every tensor input marked static, so
that the only symbolic values are the Python ints the NPU attention kernel takes as ``SymInt[]``, the sequence
lengths); on the emulated device :class:`.emulated.standin.StandInBackend` (``aot_eager`` with the on-disk cache,
``dynamic=False``: its reference attention reads tensors only). The cache directory is
:class:`.compile_cache.CompileCache` of this worker's key under ``npu.torchair_cache_dir`` (``npu.torchair_cache=false``
turns it off).

Counts (this process, all engines): :data:`TORCHAIR_STATS`. ``compiles`` counts, per batch size, every graph Dynamo
handed to the compiler; a second compile of the same size by the same wrapper (a guard failed) is a ``recompile``.
"""

from __future__ import annotations

import time
import types
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from vllm.compilation.cuda_graph import CUDAGraphOptions, CUDAGraphWrapper
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import get_forward_context
from vllm_npu.interface import COMPILED_STEP, AdditionalConfig, GraphInputsProvider, get_logger, graph_inputs_of

from .compile_cache import CompileCache, default_cache_root, kv_cache_layout, worker_cache
from .config import sparse_attention
from .dp_pad import dp_padded_pass, dp_pass_size, run_dummy_at, token_rows, unpad_rows
from .wrapper import register_wrapper

logger = get_logger(__name__)


#: What marks a MoE exchange's node in a Dynamo graph (``TorchairStats.moe_exchange_nodes``).
_EXCHANGES = {
    "mc2": ("mc2_dispatch", "npu_moe_distribute_dispatch"),
    "all_gather": ("all_gather_into_tensor",),
    "reduce_scatter": ("reduce_scatter_tensor",),
}


@dataclass
class TorchairStats:
    """Per-process counts of the torchair mode (see the module docstring)."""

    compiles: Counter[int] = field(default_factory=Counter)  # batch size -> graphs handed to the compiler
    recompiles: int = 0  # compiles of an already compiled (wrapper, batch size)
    lowerings: int = 0  # emulated: AOTAutograd lowerings run (cache misses and uncached compiles)
    cache_hits: int = 0  # emulated: lowered graphs loaded from the cache directory
    cache_writes: int = 0  # emulated: lowered graphs written to the cache directory
    uncacheable: int = 0  # emulated: lowered graphs that could not be cached (reason logged)
    opaque_attention_nodes: int = 0  # vLLM opaque attention op calls in the compiled graphs (0: attention in-graph)
    opaque_moe_nodes: int = 0  # vLLM opaque MoE op calls (moe_forward, moe_forward_shared) in them (0: MoE in-graph)
    #: MoE exchanges in the compiled graphs: "mc2" (MC2 dispatch calls, kernel or twin), "all_gather" /
    #: "reduce_scatter" (functional collectives of the data-parallel MoE)
    moe_exchange_nodes: Counter[str] = field(default_factory=Counter)
    graph_inputs_prepared: int = 0  # attention metadata objects laid out as graph inputs before compiled steps
    compiled_calls: Counter[int] = field(default_factory=Counter)  # batch size -> decode steps run compiled
    #: the draft model's (EAGLE / MTP, :class:`DraftTorchairWrapper`): batch size -> graphs compiled, passes run
    draft_compiles: Counter[int] = field(default_factory=Counter)
    draft_compiled_calls: Counter[int] = field(default_factory=Counter)
    eager_calls: int = 0  # steps run eagerly (prefill, mixed, or larger than every compiled size)
    declined_steps: int = 0  # steps dispatched to a compiled size that the attention metadata declined (run eagerly)
    compile_seconds: dict[int, float] = field(default_factory=dict)  # batch size -> first call (compile + run), last
    backend_seconds: dict[int, float] = field(default_factory=dict)  # emulated: size -> lowering or loading, last

    def snapshot(self) -> dict[str, Any]:
        return {
            "compiles": dict(self.compiles),
            "recompiles": self.recompiles,
            "lowerings": self.lowerings,
            "cache_hits": self.cache_hits,
            "cache_writes": self.cache_writes,
            "uncacheable": self.uncacheable,
            "opaque_attention_nodes": self.opaque_attention_nodes,
            "opaque_moe_nodes": self.opaque_moe_nodes,
            "moe_exchange_nodes": dict(self.moe_exchange_nodes),
            "graph_inputs_prepared": self.graph_inputs_prepared,
            "compiled_calls": dict(self.compiled_calls),
            "draft_compiles": dict(self.draft_compiles),
            "draft_compiled_calls": dict(self.draft_compiled_calls),
            "eager_calls": self.eager_calls,
            "declined_steps": self.declined_steps,
            "compile_seconds": dict(self.compile_seconds),
            "backend_seconds": dict(self.backend_seconds),
        }


TORCHAIR_STATS = TorchairStats()


def _npu_config(vllm_config: VllmConfig) -> AdditionalConfig:
    # The platform refused a non-object --additional-config when it checked the config.
    extra = vllm_config.additional_config
    return AdditionalConfig.from_vllm(extra if isinstance(extra, Mapping) else None)


def torchair_enabled(vllm_config: VllmConfig) -> bool:
    """Whether this engine runs the torchair mode."""
    return _npu_config(vllm_config).graph_mode == "torchair"


def attention_in_graph(vllm_config: VllmConfig) -> bool:
    """Whether this engine's attention is compiled into the torchair decode graph (the torchair mode with a GQA or
    MLA model; DeepSeek-V3.2's sparse attention keeps vLLM's opaque op): the platform's ``opaque_attention_op()``
    answer is its negation."""
    return torchair_enabled(vllm_config) and vllm_config.model_config is not None and not sparse_attention(vllm_config)


def _graph_inputs(size: int) -> dict[str, object] | None:
    """This step's graph inputs of the size-``size`` graph: attention layer name -> its metadata's inputs, for the
    metadata that provides them (:func:`vllm_npu.interface.protocols.graph_inputs_of`; SFA's does not). None when a
    provider declines the step (a speculative verification batch holding a prompt's first tokens): run it eagerly."""
    metadata = get_forward_context().attn_metadata
    inputs: dict[str, object] = {}
    if not isinstance(metadata, Mapping):
        return inputs
    made: dict[int, object | None] = {}  # one metadata object per KV-cache group, under every layer name of the group
    for name, md in metadata.items():
        if id(md) not in made:
            made[id(md)] = graph_inputs_of(md, size)
            if made[id(md)] is None and isinstance(md, GraphInputsProvider):
                return None
            TORCHAIR_STATS.graph_inputs_prepared += int(made[id(md)] is not None)
        if made[id(md)] is not None:
            inputs[name] = made[id(md)]
    return inputs


def _mark_static(args: tuple[Any, ...], kwargs: Mapping[str, Any], vllm_config: VllmConfig) -> None:
    """NPU, before a size's first call: every tensor the graph reads keeps the shape it has now (torchair compiles
    with ``dynamic=True`` so that the attention lengths are symbolic, as vllm-ascend v0.11.0 does)."""
    tensors: list[torch.Tensor] = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, Mapping):  # the graph inputs
            for inputs in x.values():
                tensors += [v for v in vars(inputs).values() if isinstance(v, torch.Tensor)]
    for layer in vllm_config.compilation_config.static_forward_context.values():
        tensors += [t for t in getattr(layer, "kv_cache", ()) if isinstance(t, torch.Tensor)]
    for t in tensors:
        torch._dynamo.mark_static(t)


def _compiled_forward(self: torch.nn.Module, graph_inputs: Mapping[str, object], *args: Any, **kwargs: Any) -> Any:
    # Stored as the first statement of the compiled function, so Dynamo tracks it: the attention impls read the
    # argument itself (graph inputs), not a module global (constants). See vllm_npu.interface.graphs.CompiledStep.
    COMPILED_STEP.inputs = graph_inputs
    return type(self).forward(self, *args, **kwargs)


def forward_for(model: torch.nn.Module, batch_size: int, prefix: str = "") -> Callable[..., Any]:
    """The function compiled for ``batch_size``: ``(graph_inputs, *forward_args, **forward_kwargs)``, bound to
    ``model``, which stores ``graph_inputs`` where the attention impls read it and runs ``model.forward``; a copy with
    its own code object and name (``<prefix><forward>_torchair_bs<N>``; the draft model's ``draft_``)."""
    forward = type(model).forward
    name = f"{prefix}{forward.__name__}_torchair_bs{batch_size}"
    code = _compiled_forward.__code__.replace(co_name=name)
    fn = types.FunctionType(code, _compiled_forward.__globals__, name)
    fn.__qualname__ = f"{forward.__qualname__}_torchair_bs{batch_size}"
    return types.MethodType(fn, model)


def _compile_cache(vllm_config: VllmConfig, device_type: str) -> CompileCache | None:
    """The compile cache of this worker, None with ``npu.torchair_cache=false``. Its key holds the KV caches'
    shapes (:func:`.compile_cache.kv_cache_layout`), so it can only be computed once they are allocated."""
    npu = _npu_config(vllm_config)
    if not npu.torchair_cache:
        return None
    root = default_cache_root() if npu.torchair_cache_dir is None else Path(npu.torchair_cache_dir)
    layout = kv_cache_layout(vllm_config)
    return worker_cache(vllm_config, root, device_type=device_type, kernels=npu.kernels, kv_cache=layout)


class TorchairWrapper(CUDAGraphWrapper):
    """The model, with pure-decode steps run through its compiled forward for the step's padded batch size.

    A ``CUDAGraphWrapper`` subclass so that vLLM's checks of the model (``get_model`` unwrapping) hold; no graph
    is captured. Batches dispatched with runtime mode FULL must carry the padded size in the forward context's
    batch descriptor (vLLM's dispatcher does); the first call of a size compiles it.

    The compile cache (``cache``) is chosen at the first compile, not here: the model is wrapped at load time,
    before the KV caches exist, and their shapes are part of the key.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        vllm_config: VllmConfig,
        runtime_mode: CUDAGraphMode = CUDAGraphMode.FULL,
        cudagraph_options: CUDAGraphOptions | None = None,
    ) -> None:
        from .._device import device_backend

        super().__init__(runnable, vllm_config, runtime_mode, cudagraph_options)
        self.device_type = device_backend().type
        self.cache: CompileCache | None = None  # set at the first compile (see the class docstring)
        self.compiled: dict[int, Callable[..., Any]] = {}
        self.compile_counts: Counter[int] = Counter()
        register_wrapper(self)

    #: the compiled functions' name prefix (and which counts they add to): "" for the target model
    prefix = ""

    def _prepared_cache(self) -> CompileCache | None:
        if self.cache is None:
            self.cache = _compile_cache(self.vllm_config, self.device_type)
            if self.cache is not None:
                logger.info("torchair mode: compile cache %s", self.cache.prepare())
        return self.cache

    def reset_graphs(self) -> int:
        """Forget every compiled size (sleep mode: on an NPU the graphs hold the weights' device addresses,
        ``frozen_parameter``); the next call of each size compiles it again, through the compile cache when it is
        on. Returns how many sizes were compiled."""
        n = len(self.compiled)
        self.compiled.clear()
        self.compile_counts.clear()  # a compile after a reset is a new compile, not a guard failure
        return n

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        metadata: object = context.attn_metadata
        if context.cudagraph_runtime_mode != self.runtime_mode or context.batch_descriptor is None:
            TORCHAIR_STATS.eager_calls += 1
            if metadata is None:
                # vLLM's dummy batch of a DP rank without requests while another rank runs a prefill or mixed step
                # (mode NONE): one row against the DP-padded count of the forward context (.dp_pad)
                return run_dummy_at(self.runnable, args, kwargs, dp_pass_size(0))
            return self.runnable(*args, **kwargs)
        size = context.batch_descriptor.num_tokens
        if metadata is None:
            # vLLM's dummy batch of a DP rank without requests: one row under the padded size's descriptor and no
            # metadata to lay out; eagerly at the other ranks' size (the MoE exchange's shapes; .dp_pad)
            TORCHAIR_STATS.eager_calls += 1
            return run_dummy_at(self.runnable, args, kwargs, size)
        inputs = _graph_inputs(size)
        if inputs is None:
            TORCHAIR_STATS.eager_calls += 1
            TORCHAIR_STATS.declined_steps += 1
            return self.runnable(*args, **kwargs)
        TORCHAIR_STATS.compiled_calls[size] += 1
        return self._run_compiled(size, inputs, args, kwargs)

    def _run_compiled(self, size: int, inputs: dict[str, object], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            compiled = self.compiled.get(size)
            if compiled is not None:
                return compiled(inputs, *args, **kwargs)
            if self.device_type == "npu":
                _mark_static((inputs, *args), kwargs, self.vllm_config)
            start = time.perf_counter()
            compiled = self.compiled[size] = self._compile(size)
            output = compiled(inputs, *args, **kwargs)  # Dynamo and the backend run on this first call
            TORCHAIR_STATS.compile_seconds[size] = time.perf_counter() - start
            return output
        finally:
            COMPILED_STEP.inputs = None  # eager steps see no graph inputs

    def _counted(self, size: int, backend: Callable[..., Any]) -> Callable[..., Any]:
        def count_then_compile(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self.compile_counts[size] += 1
            (TORCHAIR_STATS.draft_compiles if self.prefix else TORCHAIR_STATS.compiles)[size] += 1
            calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            TORCHAIR_STATS.opaque_attention_nodes += sum("unified_attention" in t for t in calls)
            TORCHAIR_STATS.opaque_moe_nodes += sum("vllm.moe_forward" in t for t in calls)
            for name, marks in _EXCHANGES.items():
                TORCHAIR_STATS.moe_exchange_nodes[name] += sum(any(m in t for m in marks) for t in calls)
            if self.compile_counts[size] > 1:
                TORCHAIR_STATS.recompiles += 1
                logger.warning("torchair mode: batch size %d recompiled (a Dynamo guard failed)", size)
            return backend(gm, example_inputs)

        return count_then_compile

    def _compile(self, size: int) -> Callable[..., Any]:
        fn = forward_for(cast(torch.nn.Module, self.runnable), size, self.prefix)
        cache = self._prepared_cache()
        if self.device_type == "npu":
            from ._torchair_npu import compile_npu

            return compile_npu(fn, None if cache is None else str(cache.directory))
        from .emulated.standin import StandInBackend

        backend = self._counted(size, StandInBackend(size, cache, TORCHAIR_STATS))
        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


class DraftTorchairWrapper(TorchairWrapper):
    """The draft model of EAGLE / MTP speculative decoding with its pure-decode passes compiled per padded size, as
    vllm-ascend v0.11.0's torchair MTP proposer compiles its draft (``torchair/torchair_mtp_proposer.py``).

    vLLM's ``EagleProposer`` runs the draft with runtime mode NONE; with ``use_cuda_graph`` on (the model runner sets
    it in this mode) it pads each pass to a capture size from its persistent buffers. A pass runs compiled when its
    size is a capture size and every attention metadata object of the pass lays itself out as graph inputs: the
    first pass of a verification step (``1 + k`` tokens per request, one graph row per token) and the later passes
    (one token per request). A pass with a prefill chunk, vLLM's metadata-less dummy runs and every other size run
    eagerly. Sizes compile at their first such pass (while serving), counted apart from the target's
    (``TORCHAIR_STATS.draft_compiles`` / ``draft_compiled_calls``); a second compile of a size is a recompile.
    With data parallelism each pass is first padded to the largest DP rank's size (:mod:`.dp_pad`).
    """

    prefix = "draft_"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        local = token_rows(kwargs)
        if local < 0:
            return self._run(local, args, kwargs)
        # with data parallelism every rank runs the pass at the largest rank's size (the MoE exchange's static shapes)
        with dp_padded_pass(kwargs, local) as (padded_kwargs, size):
            return unpad_rows(self._run(size, args, padded_kwargs), local)

    def _run(self, size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        sizes = self.vllm_config.compilation_config.cudagraph_capture_sizes or []
        inputs: dict[str, object] | None = None
        if size in sizes:
            try:
                inputs = _graph_inputs(size)
            except ValueError:  # a pass with a prefill chunk: not a decode graph's step
                inputs = None
        if not inputs:
            TORCHAIR_STATS.eager_calls += 1
            return self.runnable(*args, **kwargs)
        TORCHAIR_STATS.draft_compiled_calls[size] += 1
        return self._run_compiled(size, inputs, args, kwargs)
