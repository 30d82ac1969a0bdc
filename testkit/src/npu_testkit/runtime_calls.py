# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Find the NPU *runtime* calls of a source file (device, memory, streams, graphs, torchair, profiler, HCCL), by AST.

The kernel calls (``torch_npu.npu_*`` ops) are found by :func:`npu_testkit.npu_call_scan.find_npu_call_sites`;
this module finds everything else our sources ask of torch_npu's runtime, so that ``docs/npu-calls.md`` can keep a
row per runtime call site too (``tests/contract/test_npu_call_table.py``). A runtime call is spelled one of:

- ``torch.npu.<name>(...)`` (torch_npu registers ``torch.npu`` at import);
- ``torch_npu.<ns>.<name>(...)`` with ``<ns>`` one of torch_npu's non-op namespaces (``_C``, ``npu``, ``profiler``,
  ``op_plugin``, ``dynamo``...);
- ``torchair.<name>(...)``;
- ``_torch_npu().<name>(...)`` / ``_npu().<name>(...)``, the plugin's accessors that return ``torch.npu`` after
  importing torch_npu, or a local name bound to one of their results or to ``torch.npu`` itself (``npu = _npu()``
  ... ``npu.graph(...)``);
- a local name bound to a torch_npu runtime namespace (``profiler = torch_npu.profiler``), where it is called;
- ``from torch_npu.<ns>... import <name>`` / ``from torchair... import <name>`` (reported as ``<module>.<name>``);
- ``<anything>.get_hccl_comm_name(...)`` (ProcessGroupHCCL's method, reached through ``_get_backend``).

The accessor forms are reported as ``torch.npu.<name>``. A call inside a nested function is keyed by the dotted
scope (``Class.method``), as the kernel scan does.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

#: torch_npu attribute namespaces that hold runtime APIs rather than ops.
RUNTIME_NAMESPACES = ("_C", "npu", "profiler", "op_plugin", "dynamo", "utils", "contrib")
#: Functions of our sources that return ``torch.npu`` (after importing torch_npu).
ACCESSORS = ("_torch_npu", "_npu")


@dataclass(frozen=True)
class RuntimeCallSite:
    path: str
    function: str
    call: str
    line: int


def _chain(node: ast.AST) -> tuple[list[str], ast.AST]:
    """The attribute names from the root outwards, and the root node."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return parts[::-1], node


def _is_accessor_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS


def _runtime_prefix(node: ast.AST) -> str | None:
    """``torch.npu`` for an accessor call or ``torch.npu`` itself, ``torch_npu.<ns>[...]`` for an attribute chain into a
    runtime namespace (``torch_npu.profiler``), else None."""
    if _is_accessor_call(node):
        return "torch.npu"
    parts, root = _chain(node)
    if not isinstance(root, ast.Name) or not parts:
        return None
    if root.id == "torch" and parts == ["npu"]:
        return "torch.npu"
    if root.id == "torch_npu" and parts[0] in RUNTIME_NAMESPACES:
        return ".".join(["torch_npu", *parts])
    return None


def _name(node: ast.AST, aliases: dict[str, str], call: bool) -> str | None:
    """The runtime name ``node`` (an attribute chain, called when ``call``) uses, or None."""
    parts, root = _chain(node)
    if not parts:
        return None
    if parts[-1] == "get_hccl_comm_name":
        return "ProcessGroupHCCL.get_hccl_comm_name" if call else None
    if _is_accessor_call(root):
        return ".".join(["torch.npu", *parts])
    if not isinstance(root, ast.Name):
        return None
    if root.id in aliases:
        prefix = aliases[root.id]
        # an alias of a torch_npu namespace (``profiler = torch_npu.profiler``) counts where it is called; reading
        # its constants (``profiler.ProfilerActivity.NPU``) is part of that call
        return ".".join([prefix, *parts]) if call or prefix == "torch.npu" else None
    if root.id == "torch" and parts[0] == "npu" and len(parts) >= 2:
        return ".".join(["torch", *parts])
    if root.id == "torch_npu" and parts[0] in RUNTIME_NAMESPACES and len(parts) >= 2:
        return ".".join(["torch_npu", *parts])
    if root.id == "torchair":
        return ".".join(["torchair", *parts])
    return None


def _aliases(body: list[ast.stmt]) -> dict[str, str]:
    """Local names bound to ``torch.npu`` or a torch_npu runtime namespace in this scope (``npu = _npu()``,
    ``npu: Any = torch.npu``, ``profiler = torch_npu.profiler``), with what they stand for."""
    names: dict[str, str] = {}
    for stmt in body:
        for node in ast.walk(stmt):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            prefix = _runtime_prefix(node.value)
            if prefix is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update((t.id, prefix) for t in targets if isinstance(t, ast.Name))
    return names


def _imported(node: ast.ImportFrom) -> list[str]:
    """``from torch_npu.<runtime ns>... import x`` / ``from torchair... import x``: the names it brings in."""
    if node.level:  # a relative import is one of ours (``from .torchair import ...``)
        return []
    module = node.module or ""
    top, _, rest = module.partition(".")
    runtime = (top == "torch_npu" and rest.split(".")[0] in RUNTIME_NAMESPACES) or top == "torchair"
    return [f"{module}.{alias.name}" for alias in node.names] if runtime else []


def find_runtime_call_sites(source: str, path: str = "<string>") -> list[RuntimeCallSite]:
    """Every runtime call of ``source`` (see the module docstring), with its enclosing function. An attribute of
    ``torch.npu`` that is read but not called there (``"Stream": npu.Stream``, ``npu.config.allow_internal_format =
    False``) counts as a site too, and so does a name imported from a runtime namespace (``from
    torch_npu._C._distributed_c10d import ProcessGroupHCCL``): each is a use of the runtime all the same."""
    sites: list[RuntimeCallSite] = []

    def add(name: str | None, scope: tuple[str, ...], line: int) -> None:
        if name is not None:
            sites.append(RuntimeCallSite(path, ".".join(scope), name, line))

    def visit(node: ast.AST, scope: tuple[str, ...], aliases: dict[str, str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, (*scope, child.name), {**aliases, **_aliases(child.body)})
            elif isinstance(child, ast.ClassDef):
                visit(child, (*scope, child.name), aliases)
            elif isinstance(child, ast.ImportFrom):
                for name in _imported(child):
                    add(name, scope, child.lineno)
            elif isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                name = _name(child.func, aliases, call=True)
                add(name, scope, child.lineno)
                # the callee's chain is done; its root (an accessor call) and the arguments may hold more
                for sub in [*child.args, *child.keywords]:
                    visit(sub, scope, aliases)
                if name is None:
                    visit(child.func, scope, aliases)
            elif isinstance(child, ast.Attribute):  # the outermost attribute of a chain that is not called
                name = _name(child, aliases, call=False)
                add(name, scope, child.lineno)
                if name is None:
                    visit(child, scope, aliases)
            else:
                visit(child, scope, aliases)

    visit(ast.parse(source, filename=path), (), {})
    return sites
