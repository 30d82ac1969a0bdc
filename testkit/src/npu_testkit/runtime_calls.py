# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Find the NPU *runtime* calls of a source file (device, memory, streams, graphs, torchair, profiler, HCCL), by AST.

The kernel calls (``torch_npu.npu_*`` ops) are found by :func:`npu_testkit.torch_npu_docs.find_npu_call_sites`;
this module finds everything else our sources ask of torch_npu's runtime, so that ``docs/npu-calls.md`` can keep a
row per runtime call site too (``tests/contract/test_npu_call_table.py``). A runtime call is spelled one of:

- ``torch.npu.<name>(...)`` (torch_npu registers ``torch.npu`` at import);
- ``torch_npu.<ns>.<name>(...)`` with ``<ns>`` one of torch_npu's non-op namespaces (``_C``, ``npu``, ``profiler``,
  ``op_plugin``, ``dynamo``...);
- ``torchair.<name>(...)``;
- ``_torch_npu().<name>(...)`` / ``_npu().<name>(...)``, the plugin's accessors that return ``torch.npu`` after
  importing torch_npu, or a local name bound to one of their results or to ``torch.npu`` itself (``npu = _npu()``
  ... ``npu.graph(...)``);
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


def _call_name(func: ast.AST, aliases: set[str]) -> str | None:
    parts, root = _chain(func)
    if not parts:
        return None
    if parts[-1] == "get_hccl_comm_name":
        return "ProcessGroupHCCL.get_hccl_comm_name"
    if _is_accessor_call(root) or (isinstance(root, ast.Name) and root.id in aliases):
        return ".".join(["torch.npu", *parts])
    if not isinstance(root, ast.Name):
        return None
    if root.id == "torch" and parts[0] == "npu" and len(parts) >= 2:
        return ".".join(["torch", *parts])
    if root.id == "torch_npu" and parts[0] in RUNTIME_NAMESPACES and len(parts) >= 2:
        return ".".join(["torch_npu", *parts])
    if root.id == "torchair":
        return ".".join(["torchair", *parts])
    return None


def _is_torch_npu_module(node: ast.AST) -> bool:
    parts, root = _chain(node)
    return parts == ["npu"] and isinstance(root, ast.Name) and root.id == "torch"


def _aliases(body: list[ast.stmt]) -> set[str]:
    """Local names bound to ``torch.npu`` in this scope (``npu = _npu()``, ``npu: Any = torch.npu``)."""
    names: set[str] = set()
    for stmt in body:
        for node in ast.walk(stmt):
            if (
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and node.value is not None
                and (_is_accessor_call(node.value) or _is_torch_npu_module(node.value))
            ):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def find_runtime_call_sites(source: str, path: str = "<string>") -> list[RuntimeCallSite]:
    """Every runtime call of ``source`` (see the module docstring), with its enclosing function. An attribute of
    ``torch.npu`` that is read but not called there (``"Stream": npu.Stream``, ``npu.config.allow_internal_format =
    False``) counts as a site too: it is a use of the runtime all the same."""
    sites: list[RuntimeCallSite] = []

    def visit(node: ast.AST, scope: tuple[str, ...], aliases: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, (*scope, child.name), aliases | _aliases(child.body))
                continue
            if isinstance(child, ast.ClassDef):
                visit(child, (*scope, child.name), aliases)
                continue
            if isinstance(child, ast.Attribute):  # the outermost attribute of a chain (inner ones are not visited)
                name = _call_name(child, aliases)
                if name is not None:
                    sites.append(RuntimeCallSite(path, ".".join(scope), name, child.lineno))
                    # the chain's root may be an accessor call with arguments worth visiting; nothing else inside
                    continue
            visit(child, scope, aliases)

    visit(ast.parse(source, filename=path), (), set())
    return sites
