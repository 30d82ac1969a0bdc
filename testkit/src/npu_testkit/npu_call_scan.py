# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Find the torch_npu kernel calls of a source file, by AST (nothing is imported or run).

:func:`find_npu_calls` gives every ``torch_npu.<op>(...)`` / ``torch_npu.atb.<op>(...)`` call with its arguments'
shape (what :func:`npu_testkit.torch_npu_docs.check_calls` holds against the documented signatures);
:func:`find_npu_call_sites` every call of a torch_npu op or of a ``torch.ops.custom`` / ``torch.ops._C_ascend`` /
``torch.ops.atb`` op with its enclosing function (the kernel table of ``docs/npu-calls.md``). The runtime calls
(device, streams, graphs...) are :mod:`npu_testkit.runtime_calls`' business.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass


@dataclass(frozen=True)
class NPUCall:
    """One ``torch_npu.<name>(...)`` / ``torch_npu.atb.<name>(...)`` call found in source."""

    path: str
    line: int
    namespace: str
    name: str
    n_positional: int
    keywords: tuple[str, ...]
    star_args: bool
    star_kwargs: bool

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _attr_chain(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def find_npu_calls(source: str, path: str = "<string>") -> list[NPUCall]:
    """Every call whose callee is spelled ``torch_npu.<name>`` or ``torch_npu.atb.<name>`` (also ``.out`` forms)."""
    calls = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if not isinstance(node, ast.Call):
            continue
        chain = _attr_chain(node.func)
        if not chain or chain[0] != "torch_npu" or len(chain) < 2:
            continue
        if chain[1] == "atb" and len(chain) >= 3:
            namespace, name = "atb", ".".join(chain[2:])
        elif chain[1] in ("npu", "_C", "utils", "contrib", "profiler", "dynamo"):
            continue  # module namespaces (device/runtime APIs), not ops
        else:
            namespace, name = "", ".".join(chain[1:])
        star_args = any(isinstance(a, ast.Starred) for a in node.args)
        calls.append(
            NPUCall(
                path=path,
                line=node.lineno,
                namespace=namespace,
                name=name,
                n_positional=sum(not isinstance(a, ast.Starred) for a in node.args),
                keywords=tuple(k.arg for k in node.keywords if k.arg is not None),
                star_args=star_args,
                star_kwargs=any(k.arg is None for k in node.keywords),
            )
        )
    return calls


@dataclass(frozen=True)
class CallSite:
    """Where an NPU op is called: ``function`` is the enclosing ``Class.method`` / function (``""`` at module level),
    ``op`` the callee as spelled (``torch_npu.npu_rms_norm``, ``torch_npu.atb.npu_ring_mla``,
    ``torch.ops.custom.npu_lightning_indexer``)."""

    path: str
    function: str
    op: str
    line: int


_NON_OP_NAMESPACES = ("npu", "_C", "utils", "contrib", "profiler", "dynamo")
_CUSTOM_OP_PREFIXES = (("torch", "ops", "custom"), ("torch", "ops", "_C_ascend"), ("torch", "ops", "atb"))


def _npu_op_name(chain: list[str] | None) -> str | None:
    if not chain or len(chain) < 2:
        return None
    if chain[0] == "torch_npu" and chain[1] not in _NON_OP_NAMESPACES and not (chain[1] == "atb" and len(chain) < 3):
        return ".".join(chain)
    if len(chain) >= 4 and tuple(chain[:3]) in _CUSTOM_OP_PREFIXES:
        return ".".join(chain)
    return None


def find_npu_call_sites(source: str, path: str = "<string>") -> list[CallSite]:
    """Every call of a torch_npu op (the calls :func:`find_npu_calls` checks) or of a ``torch.ops.custom`` /
    ``torch.ops._C_ascend`` / ``torch.ops.atb`` op, with its enclosing function."""
    sites: list[CallSite] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, (*scope, child.name))
                continue
            if isinstance(child, ast.Call):
                op = _npu_op_name(_attr_chain(child.func))
                if op is not None:
                    sites.append(CallSite(path, ".".join(scope), op, child.lineno))
            visit(child, scope)

    visit(ast.parse(source, filename=path), ())
    return sites
