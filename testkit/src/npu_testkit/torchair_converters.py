# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The GE converters of torch_npu 2.8.0's bundled torchair, read from the wheel without importing it.

torchair's ``max-autotune`` mode hands the FX graph to GE, which needs an Ascend-IR converter for every node.
Converters are Python functions under ``torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/`` decorated with
``@register_fx_node_ge_converter(torch.ops.<namespace>.<op>.<overload>)``. Some exist only to refuse: their body is
a docstring and ``raise NotImplementedError(...)`` (``aten._local_scalar_dense``, say), which fails the compile the
same way as a missing one. Others raise only for some arguments (``partial``): they convert the common case.

:func:`converter_table` maps ``"<namespace>.<op>.<overload>"`` (``"npu.npu_rms_norm.default"``,
``"aten.add.Tensor"``) to :data:`IMPLEMENTED`, :data:`PARTIAL` or :data:`NOT_IMPLEMENTED`;
:func:`missing_converters` names the ops of a list that GE could not convert. For tests that compile code the way the
torchair mode does: :func:`compile_lowered` (the lowered aten graphs), :func:`graph_ops` / :func:`symbolic_inputs`
(what to check in them) and :func:`fresh_dynamo_imports` (code that imports a fake ``torch_npu``). The wheel is
:func:`npu_testkit.torch_npu_docs.wheel_path`'s (downloaded once, cached).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from npu_testkit.torch_npu_docs import wheel_path

CONVERTER_DIR = "torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/"
DECORATOR = "register_fx_node_ge_converter"
IMPLEMENTED = "implemented"
PARTIAL = "partial"
NOT_IMPLEMENTED = "not implemented"


def _op_name(node: ast.expr) -> str | None:
    """``torch.ops.npu.npu_rms_norm.default`` -> ``"npu.npu_rms_norm.default"``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id != "torch" or len(parts) < 4 or parts[-1] != "ops":
        return None
    return ".".join(reversed(parts[:-1]))


def _raises_not_implemented(stmt: ast.stmt) -> bool:
    if not isinstance(stmt, ast.Raise) or stmt.exc is None:
        return False
    exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _status(fn: ast.FunctionDef) -> str:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]  # the docstring
    if len(body) == 1 and _raises_not_implemented(body[0]):
        return NOT_IMPLEMENTED
    if any(_raises_not_implemented(n) for n in ast.walk(fn) if isinstance(n, ast.stmt)):
        return PARTIAL
    return IMPLEMENTED


def _registered_op(call: ast.expr) -> str | None:
    """``register_fx_node_ge_converter(torch.ops.<op>)`` -> the op's name, else None."""
    if isinstance(call, ast.Call) and getattr(call.func, "id", None) == DECORATOR and call.args:
        return _op_name(call.args[0])
    return None


def parse_converters(source: str) -> dict[str, str]:
    """The converters one ``ge_converter`` module registers: op name -> status.

    Both spellings of a registration count: the decorator, and the call ``register_fx_node_ge_converter(op)(fn)``
    on a function defined in the module (how ``custom/grouped_matmul.py`` registers ``npu_grouped_matmul``'s two
    overloads with one converter).
    """
    tree = ast.parse(source)
    functions = {fn.name: fn for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)}
    found: dict[str, str] = {}
    for fn in functions.values():
        for deco in fn.decorator_list:
            name = _registered_op(deco)
            if name is not None:
                found[name] = _status(fn)
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and len(call.args) == 1 and isinstance(call.args[0], ast.Name):
            name = _registered_op(call.func)
            target = functions.get(call.args[0].id)
            if name is not None and target is not None:
                found[name] = _status(target)
    return found


def parse_wheel_converters(wheel: Path) -> dict[str, str]:
    """Every converter of the wheel's bundled torchair: op name -> status (the best status where two modules
    register the same op)."""
    rank = {NOT_IMPLEMENTED: 0, PARTIAL: 1, IMPLEMENTED: 2}
    table: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(CONVERTER_DIR) and name.endswith(".py"):
                for op, status in parse_converters(zf.read(name).decode("utf-8")).items():
                    if rank[status] >= rank.get(table.get(op, NOT_IMPLEMENTED), 0):
                        table[op] = status
    return table


@functools.lru_cache(maxsize=1)
def converter_table() -> dict[str, str]:
    """torch_npu 2.8.0's torchair converters: ``"<namespace>.<op>.<overload>"`` -> status."""
    return parse_wheel_converters(wheel_path())


@functools.cache
def converter_parameters(op: str) -> tuple[str, ...]:
    """The parameter names of the wheel's converter of ``op`` (``"npu.npu_swiglu.default"``), positional and
    keyword-only, without torchair's own ``meta_outputs``: the arguments GE can be handed for that op."""
    with zipfile.ZipFile(wheel_path()) as zf:
        for name in zf.namelist():
            if not (name.startswith(CONVERTER_DIR) and name.endswith(".py")):
                continue
            tree = ast.parse(zf.read(name).decode("utf-8"))
            for fn in ast.walk(tree):
                if isinstance(fn, ast.FunctionDef) and any(_registered_op(d) == op for d in fn.decorator_list):
                    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
                    return tuple(a.arg for a in args if a.arg != "meta_outputs")
    raise KeyError(f"no decorated GE converter for {op} in torch_npu's torchair")


def missing_converters(ops: Iterable[str]) -> list[str]:
    """The ops of ``ops`` (names as in :func:`converter_table`) that GE cannot convert: no converter, or one that
    only raises ``NotImplementedError``; each with the reason."""
    table = converter_table()
    out = []
    for op in sorted(set(ops)):
        status = table.get(op)
        if status is None:
            out.append(f"{op}: no GE converter in torch_npu's torchair")
        elif status == NOT_IMPLEMENTED:
            out.append(f"{op}: its GE converter raises NotImplementedError")
    return out


@contextlib.contextmanager
def fresh_dynamo_imports() -> Iterator[None]:
    """Forget, on entry and on exit, the modules Dynamo's traced code imported.

    Dynamo resolves an ``import`` it traces through a process-wide cache by module name
    (``torch._dynamo.symbolic_convert._import_module``), so a test that compiles code importing a *fake* ``torch_npu``
    would otherwise get the first test's fake, whatever ``sys.modules`` holds now (and leave its own to the next).
    """
    from torch._dynamo import symbolic_convert

    symbolic_convert._import_module.cache_clear()
    try:
        yield
    finally:
        symbolic_convert._import_module.cache_clear()


def compile_lowered(fn: Callable[..., Any], *, dynamic: bool) -> tuple[Callable[..., Any], list[Any]]:
    """``torch.compile(fn, fullgraph=True, dynamic=dynamic)`` lowered by AOTAutograd (functionalized aten, as the
    torchair backend and the emulated stand-in see it, ``keep_inference_input_mutations=True``) and run as is; returns
    the compiled function and the list its lowered graphs are appended to (one per compile). Resets Dynamo first."""
    import torch
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[Any] = []

    def keep(gm: Any, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep, keep_inference_input_mutations=True)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic), graphs


def graph_ops(gm: Any) -> set[str]:
    """The ops a lowered graph calls, named as in :func:`converter_table` (``"npu.npu_swiglu.default"``)."""
    import torch

    return {
        f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
        for t in (n.target for n in gm.graph.nodes)
        if isinstance(t, torch._ops.OpOverload)
    }


def symbolic_inputs(gm: Any) -> list[str]:
    """The graph's inputs that are not tensors (symbolic ints): GE converters take op ints as attributes."""
    import torch

    return [n.name for n in gm.graph.nodes if n.op == "placeholder" and not isinstance(n.meta.get("val"), torch.Tensor)]
