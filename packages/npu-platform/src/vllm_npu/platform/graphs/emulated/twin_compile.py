# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Inductor compilation of the emulated twin's captured graph (``npu.emulated_compile=inductor``).

A captured graph (:mod:`.twin`) is an FX graph of aten ops whose state (weights, KV caches, vLLM's persistent
metadata buffers) is reached by reference. Compiled whole, inductor would functionalize every in-place write into a
captured buffer: the KV-cache write of each layer would become a copy of the whole cache plus a copy back, per
step, and the decode-attention tasks would read that copy. So the graph is split first:

- *state nodes* run as they were traced, in order, on the real buffers: every op that writes a captured buffer
  (a graph input or a constant: the KV write's ``index_copy_``, each updatable ``vllm_npu_graph::task``), every
  view of such a buffer, and every op reading one;
- the runs of pure nodes between them (embedding, linear layers, norms, RoPE, SwiGLU...) are compiled
  with inductor at capture (:mod:`.twin_pieces`). Views of captured buffers that read nothing (each layer's
  unbound KV cache) are first moved to their first use (:func:`sink_state_views`), so that a layer's pure nodes
  are one run rather than two, and then computed once, as constants of the graph (:func:`fold_constant_views`).

The state nodes run inline in the split graph (not as a submodule per run: a module call per layer and step costs
more than the KV write it wraps); the pure runs are its compiled submodules.

What a replay computes is unchanged: the same aten ops on the same buffers, tasks still opaque and refreshed with
the step's host parameters, inputs still checked by address (by :class:`.twin.EmulatedGraph`, around this). Only
the way a task is called changes: in the eager pieces a ``vllm_npu_graph::task`` node calls the task's Python
(:func:`.twin.run_task`) directly; the custom op exists for the tracer and for the split (its schema says what
it writes), and going through the dispatcher for it costs ~40 us a call on the CPU, per layer and step.
Shapes are those of the capture (one compile per distinct piece and capture size); pure pieces that differ only in
their weights (every decoder layer) share one compiled function.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.fx.passes.split_module import split_module

from .twin import run_task
from .twin_pieces import compile_piece

if TYPE_CHECKING:
    from ..compile_cache import CompileCache


def _schema(node: torch.fx.Node) -> torch.FunctionSchema | None:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema
    return None


def _arg_values(node: torch.fx.Node, schema: torch.FunctionSchema) -> list[tuple[torch.Argument, Any]]:
    pairs = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            pairs.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            pairs.append((arg, node.kwargs[arg.name]))
    return pairs


def _nodes_in(value: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return found


def state_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes that must run eagerly on the captured buffers (see the module docstring)."""
    root: dict[torch.fx.Node, torch.fx.Node] = {}  # node -> the node whose storage it aliases
    mutated_roots: set[torch.fx.Node] = set()
    for node in graph.nodes:
        root[node] = node
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            root[node] = root[node.args[0]]  # an element of a view op's tuple (``unbind``, ``split``)
            continue
        schema = _schema(node)
        if schema is None:
            continue
        pairs = _arg_values(node, schema)
        # A view or in-place op returns an alias of the argument that shares its alias set (always the first here).
        if schema.returns and schema.returns[0].alias_info is not None and pairs:
            first = pairs[0][1]
            if isinstance(first, torch.fx.Node):
                root[node] = root[first]
        for arg, value in pairs:
            if arg.alias_info is not None and arg.alias_info.is_write:
                for n in _nodes_in(value):
                    mutated_roots.add(root[n])
    state = {r for r in mutated_roots if r.op in ("placeholder", "get_attr")}
    eager: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if (
            root[node] in state
            or any(root[n] in state for n in _nodes_in((node.args, node.kwargs)))
            or _opaque_write(node)
            # an element of such an op's tuple (vllm::moe_forward_shared returns two): pieces take tensors only
            or (node.target is operator.getitem and node.args[0] in eager)
        ):
            eager.add(node)
    return eager


def _opaque_write(node: torch.fx.Node) -> bool:
    """A custom (non-aten) op that writes one of its arguments, e.g. vLLM's ``vllm::moe_forward(Tensor(a0!)
    hidden_states, ...) -> Tensor(a0!)``: inductor cannot functionalize it (it has no functional form), so it runs
    as traced, between the compiled pieces, even when what it writes is an intermediate."""
    schema = _schema(node)
    if schema is None or node.target.namespace in ("aten", "prims"):  # type: ignore[union-attr]
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_view(node: torch.fx.Node) -> bool:
    """A node that only makes an alias of its first argument (a view op, or an element of a view op's tuple)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    schema = _schema(node)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return False
    return not schema.returns[0].alias_info.is_write and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def sink_state_views(graph: torch.fx.Graph, eager: set[torch.fx.Node]) -> int:
    """Move each state node that is a view of a captured buffer only (no data read, no write: the per-layer views
    of the KV cache) to just before its first user, and drop such views nobody uses; returns how many moved or
    went.

    Traced in program order, those views sit between a layer's pure nodes and would cut them into two compiled
    pieces; a view reads nothing, so computing it later changes no value. Views of views move with them."""
    moved = 0
    for node in reversed(list(graph.nodes)):
        if node not in eager or not _is_view(node):
            continue
        if not node.users:  # an unused view (the value half of an unbound cache a layer never reads): dead code
            graph.erase_node(node)
            eager.discard(node)
            moved += 1
            continue
        if any(
            n.op not in ("placeholder", "get_attr") and not (n in eager and _is_view(n)) for n in node.all_input_nodes
        ):
            continue
        first = min(node.users, key=_order(graph))
        if node.next is not first:
            first.prepend(node)
            moved += 1
    return moved


def fold_constant_views(module: torch.fx.GraphModule, eager: set[torch.fx.Node]) -> int:
    """Replace each view of a captured buffer that depends on nothing else (``unbind`` of a layer's KV cache, its
    ``getitem`` and ``view`` chain) by a constant holding that view, computed once here; returns how many.

    A captured buffer never moves (replay checks inputs by address; constants are the captured tensors themselves),
    so its views are the same tensors at every replay: recomputing them costs a few dispatcher calls per layer and
    step and gives nothing. The folded constants alias the buffers, so writes through them land where they did."""
    graph = module.graph
    values: dict[torch.fx.Node, Any] = {}
    folded = 0
    for node in list(graph.nodes):
        if node.op == "get_attr":
            values[node] = _attr(module, str(node.target))
            continue
        if not (node in eager and _is_view(node)) or not all(n in values for n in node.all_input_nodes):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
        value = values[node] = node.target(*args, **kwargs)
        if isinstance(value, torch.Tensor):
            name = f"_folded_view{folded}"
            module.register_buffer(name, value, persistent=False)
            with graph.inserting_before(node):
                constant = graph.get_attr(name)
            node.replace_all_uses_with(constant)
            graph.erase_node(node)
            eager.discard(node)
            folded += 1
    for node in reversed(list(graph.nodes)):  # tuple-valued views (unbind) whose elements all became constants
        if node in values and node.op == "call_function" and not node.users:
            graph.erase_node(node)
            eager.discard(node)
    return folded


def _attr(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _inline_submodule(split: torch.fx.GraphModule, name: str) -> None:
    """Put the nodes of the split's submodule ``name`` (an eager piece: KV writes, tasks, views) into the split
    graph in place of its call, so a replay runs them without a module call per piece."""
    sub = getattr(split, name)
    graph = split.graph
    call = next(n for n in graph.nodes if n.op == "call_module" and n.target == name)
    env: dict[torch.fx.Node, Any] = dict(zip((n for n in sub.graph.nodes if n.op == "placeholder"), call.args))
    result: Any = None
    with graph.inserting_before(call):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = torch.fx.node.map_arg(node.args[0], env.__getitem__)
                break
            env[node] = graph.node_copy(node, env.__getitem__)
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(result, (tuple, list)):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
        else:
            user.replace_input_with(call, result)
    graph.erase_node(call)
    delattr(split, name)


def _order(graph: torch.fx.Graph) -> Callable[[torch.fx.Node], int]:
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


class _CompileOnFirstRun(torch.fx.Interpreter):
    """Runs the split graph once; each pending (pure) submodule is compiled on the inputs it gets
    (:func:`.twin_pieces.compile_piece`) and replaced in the split graph by the compiled function (an attribute of
    the same name, called by the graph's generated code)."""

    def __init__(self, split: torch.fx.GraphModule, pending: set[str], cache: CompileCache | None) -> None:
        super().__init__(split)
        self.split, self.pending, self.cache = split, pending, cache

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target not in self.pending:
            return super().call_module(target, args, kwargs)
        compiled = compile_piece(getattr(self.split, target), list(args), self.cache)
        delattr(self.split, target)  # the submodule; a plain callable of the same name takes its place
        setattr(self.split, target, compiled)
        self.pending.discard(target)
        return compiled(*args)


def _call_tasks_directly(piece: torch.fx.GraphModule) -> None:
    """Retarget the ``vllm_npu_graph::task`` nodes of an eager piece to :func:`.twin.run_task` (same arguments)."""
    task = torch.ops.vllm_npu_graph.task.default
    nodes = [n for n in piece.graph.nodes if n.op == "call_function" and n.target is task]
    for node in nodes:
        node.target = run_task
    if nodes:
        piece.recompile()


def compile_graph(
    module: torch.fx.GraphModule, inputs: list[torch.Tensor], cache: CompileCache | None = None
) -> Callable[..., Any]:
    """``module`` with its pure pieces compiled by inductor; called like ``module``. Runs it once on ``inputs``
    (a real step on the captured buffers, as the capture's own first run is) to compile each piece. ``cache``: the
    on-disk cache of compiled pieces (:mod:`.twin_pieces`), None for none. ``module``'s graph is reordered in place
    (:func:`sink_state_views`; same values)."""
    eager = state_nodes(module.graph)
    if sink_state_views(module.graph, eager) + fold_constant_views(module, eager):
        module.recompile()
    part: dict[torch.fx.Node, int] = {}
    current, kind = 0, None
    for node in module.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        is_eager = node in eager
        if kind is not None and is_eager != kind:
            current += 1
        kind = is_eager
        part[node] = current
    eager_parts = {part[n] for n in eager}
    split = split_module(module, module, lambda n: part[n], keep_original_order=True)
    pending = {
        name
        for name, _ in split.named_children()
        if name.startswith("submod_") and int(name.removeprefix("submod_")) not in eager_parts
    }

    for name in sorted({n for n, _ in split.named_children() if n.startswith("submod_")} - pending):
        if any(n.op not in ("placeholder", "output", "call_function") for n in getattr(split, name).graph.nodes):
            _call_tasks_directly(getattr(split, name))  # not plain calls (a submodule, an attribute): kept whole
        else:
            _inline_submodule(split, name)
    split.recompile()
    _call_tasks_directly(split)

    # Inductor's default compiles C++ in a pool of worker processes started on first use: on a small host (2 cores
    # shared with vLLM's own threads) starting that pool costs more than it saves for a few kernels per piece.
    with torch._inductor.config.patch(compile_threads=1):
        _CompileOnFirstRun(split, pending, cache).run(*inputs)
    return split
