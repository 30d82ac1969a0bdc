# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM drift guard: every private vLLM name our sources override or read is in a layer's ``_vllm_surface.py``
table, once, and the installed vLLM still has each entry with the recorded signature.

The scan imports every module under ``packages/*/src`` (so it sees real class hierarchies, mixins included) and
walks their AST:

- in a class whose MRO contains a vLLM class (and in every class of ours in that MRO, so mixins count), each
  ``def _x``, ``self._x``, ``cls._x``, ``super()._x`` and ``getattr(self, "_x")`` whose name a vLLM class of that MRO
  defines (in its namespace, its annotations or as a ``self._x`` store in its source);
- ``X._x`` where ``X`` is imported from vLLM (a class or a module);
- any other ``<expr>._x`` (a parameter, a local): the receiver's type is unknown, so the name must be one we define
  ourselves, a table entry, or listed in :data:`OTHER_LIBRARIES` with the library it belongs to.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache
from types import ModuleType
from typing import Any

import pytest
import vllm
from vllm_npu.interface import REMOVED, VllmName, check_surface, installed_surface

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Private names of other libraries that we read through receivers of unknown type: name -> owner.
OTHER_LIBRARIES = {
    "_parameters": "torch.nn.Module (read and deleted directly: nn.Module.__getattr__ is slow, del of a Parameter)",
    "_actions": "argparse.ArgumentParser (vLLM's CLI parser: the quant layer reads its --quantization choices)",
    "_SubParsersAction": "argparse",
    "_get_backend": "torch.distributed.ProcessGroup (the EP group's HCCL backend, for MC2's communicator name)",
    "_register_backend": "torch.distributed.ProcessGroup (a stateless HCCL group, as vllm-ascend v0.11.0 builds it)",
    "_set_sequence_number_for_group": "torch.distributed Backend (torch_npu's ProcessGroupHCCL of a stateless group)",
    "_timeout": "torch_npu ProcessGroupHCCL.Options (a stateless HCCL group's timeout)",
    "_ExperimentalConfig": "torch_npu.profiler (the NPU worker's profiler, as vllm-ascend v0.11.0)",
    "_base": "torch.Tensor (a view's base: the graph runtime records the storage owner a captured view reads)",
    "_dynamo_static_input_type": "torch._dynamo (the mark on static-address inputs torchair freezes)",
    "_attn_implementation": "transformers.PretrainedConfig (the attention function a transformers-built audio "
    "encoder calls: npu-models points it at the NPU encoder attention; C8 calibration / simulation use theirs)",
}


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def _module_names() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(ROOT.glob("packages/*/src/vllm_npu/**/*.py")):
        src = ROOT.joinpath(*path.relative_to(ROOT).parts[:3])  # packages/<dist>/src
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue  # runs the CLI on import
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


@cache
def _self_stores(cls: type) -> frozenset[str]:
    """Names the source of ``cls`` itself stores on ``self``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return frozenset()
    return frozenset(
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    )


def _vllm_owner(mro: tuple[type, ...], name: str) -> str | None:
    """``module:Class`` of the first vLLM class in ``mro`` that defines ``name``, or None."""
    for klass in mro:
        if not _is_vllm(klass.__module__):
            continue
        if name in vars(klass) or name in getattr(klass, "__annotations__", {}) or name in _self_stores(klass):
            return f"{klass.__module__}:{klass.__qualname__}"
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _self_receiver(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _attribute_uses(tree: ast.AST) -> list[tuple[ast.expr, str, int]]:
    """(receiver, private name, line) for ``recv._x`` and ``getattr/hasattr/setattr(recv, "_x", ...)``."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            uses.append((node.value, node.attr, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            uses.append((node.args[0], node.args[1].value, node.lineno))
    return uses


@dataclass
class Scan:
    #: (owner, name) -> our modules that rely on it
    vllm_names: dict[tuple[str, str], set[str]] = field(default_factory=lambda: defaultdict(set))
    #: private name -> "module:line" of reads through receivers of unknown type
    unresolved: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    #: private names our own sources define (defs, class attributes, self stores, module globals)
    ours: set[str] = field(default_factory=set)
    #: modules -> the attribute names their AST mentions (any receiver) or defines
    mentions: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    #: "module:line" of classes the scan cannot resolve at run time (not at a module's top level)
    unscanned_classes: list[str] = field(default_factory=list)


def _definitions(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _self_receiver(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _imports(tree: ast.AST) -> dict[str, tuple[str, str | None]]:
    """Local name -> (module, attribute or None) for every import in the module (function-level ones too)."""
    out: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = (alias.name, None)
                else:
                    out[alias.name.split(".")[0]] = (alias.name.split(".")[0], None)
    return out


def _chain(node: ast.expr) -> tuple[str, list[str]] | None:
    """``a.b.c`` -> ("a", ["b", "c"]); None for receivers that are not a dotted name."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.insert(0, node.attr)
        node = node.value
    return (node.id, attrs) if isinstance(node, ast.Name) else None


def _resolve_vllm(imports: dict[str, tuple[str, str | None]], node: ast.expr) -> Any:
    """The vLLM object a dotted receiver names (``VllmConfig``, ``_vllm_forward_context``), or None."""
    chain = _chain(node)
    if chain is None or chain[0] not in imports:
        return None
    module_name, attr = imports[chain[0]]
    if not _is_vllm(module_name):
        return None
    obj: Any = importlib.import_module(module_name)
    for part in ([attr] if attr else []) + chain[1]:
        obj = getattr(obj, part, None)
    return obj


def _is_foreign_import(imports: dict[str, tuple[str, str | None]], node: ast.expr) -> bool:
    """``node`` is rooted in a name imported from a library that is neither ours nor vLLM (torch, torch_npu...)."""
    chain = _chain(node)
    if chain is None or chain[0] not in imports:
        return False
    module_name = imports[chain[0]][0]
    return not _is_vllm(module_name) and not module_name.startswith("vllm_npu")


def _class_attributes(node: ast.ClassDef) -> list[str]:
    """Names a class body assigns (``_cudagraph_support = ...``): class attributes that override vLLM's."""
    names = []
    for stmt in node.body:
        targets = (
            stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        )
        names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


def _class_nodes(module_name: str, tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {f"{module_name}:{n.name}": n for n in tree.body if isinstance(n, ast.ClassDef)}


@cache
def scan() -> Scan:
    result = Scan()
    modules: dict[str, tuple[ModuleType, ast.Module]] = {}
    for module_name, path in _module_names():
        tree = ast.parse(path.read_text(), filename=str(path))
        modules[module_name] = (importlib.import_module(module_name), tree)
        result.ours |= {n for n in _definitions(tree) if _private(n)}
    class_nodes: dict[str, ast.ClassDef] = {}
    for module_name, (_, tree) in modules.items():
        class_nodes.update(_class_nodes(module_name, tree))

    for module_name, (module, tree) in modules.items():
        _scan_mentions(result, module_name, tree)
        _scan_subclasses(result, module, tree, class_nodes)
        _scan_attribute_uses(result, module_name, tree)
    return result


def _scan_mentions(result: Scan, module_name: str, tree: ast.Module) -> None:
    """The names a module defines or reads as attributes, and the classes the scan cannot see (nested ones)."""
    top_level = {id(n) for n in tree.body}
    result.unscanned_classes += [
        f"{module_name}:{n.lineno} {n.name}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and id(n) not in top_level
    ]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            result.mentions[module_name].add(node.name)
        elif isinstance(node, ast.Attribute):
            result.mentions[module_name].add(node.attr)
        elif isinstance(node, ast.ClassDef):
            result.mentions[module_name].update(_class_attributes(node))


def _scan_subclasses(result: Scan, module: ModuleType, tree: ast.Module, class_nodes: dict[str, ast.ClassDef]) -> None:
    """Classes of ours on top of vLLM classes, and every class of ours in their MRO (mixins)."""
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(module, node.name, None)
        if not inspect.isclass(cls) or not any(_is_vllm(b.__module__) for b in cls.__mro__):
            continue
        for klass in cls.__mro__:
            key = f"{klass.__module__}:{klass.__qualname__}"
            if key not in class_nodes:
                continue
            body = class_nodes[key]
            names = [n.name for n in body.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            names += _class_attributes(body)
            names += [name for recv, name, _ in _attribute_uses(body) if _self_receiver(recv)]
            for name in names:
                owner = _vllm_owner(cls.__mro__, name) if _private(name) else None
                if owner is not None:
                    result.vllm_names[(owner, name)].add(klass.__module__)


def _scan_attribute_uses(result: Scan, module_name: str, tree: ast.Module) -> None:
    """Attributes read on names imported from vLLM (the vLLM module or class that owns each)."""
    imports = _imports(tree)
    for recv, name, line in _attribute_uses(tree):
        if _self_receiver(recv) or _is_foreign_import(imports, recv):
            continue  # self/cls/super: handled per class above; torch_npu._x etc.: not vLLM's
        target = _resolve_vllm(imports, recv)
        if target is None:
            result.unresolved[name].add(f"{module_name}:{line}")
            continue
        if inspect.ismodule(target):
            result.vllm_names[(target.__name__, name)].add(module_name)
        else:
            owner = _vllm_owner(target.__mro__, name) if inspect.isclass(target) else None
            result.vllm_names[(owner or f"{target!r}", name)].add(module_name)


def _all_entries() -> list[tuple[str, VllmName]]:
    return [(layer, entry) for layer, table in installed_surface().items() for entry in table]


def test_installed_vllm_has_every_surface_name() -> None:
    problems = check_surface([entry for _, entry in _all_entries()], vllm_version=vllm.__version__)
    assert not problems, "vLLM drift:\n" + "\n".join(f"  - {p}" for p in problems)


def test_every_name_is_listed_once_in_the_layer_that_uses_it() -> None:
    seen: dict[tuple[str, str], str] = {}
    for layer, entry in _all_entries():
        key = (entry.owner, entry.name)
        assert key not in seen, f"{entry.qualname} is listed by both the {seen[key]} and the {layer} layer"
        seen[key] = layer
        wrong = [m for m in entry.used_by if not m.startswith(f"vllm_npu.{layer}.")]
        assert not wrong, f"vllm_npu.{layer}._vllm_surface lists {entry.qualname} for other layers' modules {wrong}"


def _entry_key(key: tuple[str, str], by_name: dict[str, list[VllmName]]) -> tuple[str, str]:
    """The table entry a scanned (defining class, name) stands for. Entries name the class we use (the 0.11.0
    owner); a later release may define the name on another class or module that the entry's owner still reaches
    (vLLM 0.11.1 moved ``VllmConfig`` to ``vllm.config.vllm`` and ``_match_cos_sin_cache_dtype`` to
    ``RotaryEmbeddingBase``): the same object, so the same entry."""
    owner, name = key
    scanned = _resolve(owner)
    for entry in by_name.get(name, []):
        if entry.owner == owner:
            return key
        table_owner = _resolve(entry.owner)
        if scanned is None or table_owner is None:
            continue
        if table_owner is scanned or (
            inspect.isclass(table_owner) and inspect.isclass(scanned) and issubclass(table_owner, scanned)
        ):
            return (entry.owner, name)
    return key


def _resolve(owner: str) -> Any:
    module_name, _, qual = owner.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qual.split(".") if qual else ():
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


def test_surface_tables_are_complete() -> None:
    """No private vLLM name is used in packages/*/src without a table entry (and each entry names its users)."""
    result = scan()
    assert not result.unscanned_classes, (
        "the scan resolves classes by their module attribute, so it sees only top-level classes; move these, or "
        "teach the scan about them: " + ", ".join(result.unscanned_classes)
    )
    entries = {(e.owner, e.name): e for _, e in _all_entries()}
    by_name: dict[str, list[VllmName]] = defaultdict(list)
    for entry in entries.values():
        by_name[entry.name].append(entry)
    users: dict[tuple[str, str], set[str]] = defaultdict(set)
    scanned = {_entry_key(key, by_name): modules for key, modules in result.vllm_names.items()}
    for key, modules in scanned.items():
        users[key] |= modules
    missing = [
        f"{owner}.{name} used by {', '.join(sorted(mods))}"
        for (owner, name), mods in sorted(scanned.items())
        if (owner, name) not in entries
    ]
    unknown = []
    for name, places in sorted(result.unresolved.items()):
        if name in by_name:
            for entry in by_name[name]:
                users[(entry.owner, entry.name)] |= {p.rpartition(":")[0] for p in places}
        elif name not in result.ours and name not in OTHER_LIBRARIES:
            unknown.append(f"{name} at {', '.join(sorted(places))}")
    assert not missing, (
        "private vLLM names used without an entry in the using layer's _vllm_surface.py SURFACE:\n  "
        + "\n  ".join(missing)
    )
    assert not unknown, (
        "private names read through a receiver of unknown type that we do not define: add a _vllm_surface.py entry "
        "if vLLM owns them, else name their library in OTHER_LIBRARIES:\n  " + "\n  ".join(unknown)
    )
    wrong_users = [
        f"{entry.qualname}: used_by {sorted(entry.used_by)}, the scan finds {sorted(users[key])}"
        for key, entry in entries.items()
        # An entry removed in the installed release has no vLLM owner left for the scan to attribute uses to.
        if _private(entry.name) and entry.expected(vllm.__version__) != REMOVED and set(entry.used_by) != users[key]
    ]
    assert not wrong_users, "used_by does not match the sources:\n  " + "\n  ".join(wrong_users)


@pytest.mark.parametrize("layer_entry", _all_entries(), ids=lambda le: f"{le[0]}:{le[1].qualname}")
def test_every_entry_is_still_used(layer_entry: tuple[str, VllmName]) -> None:
    """A stale entry (public hooks included) guards nothing: each module in used_by still mentions the name."""
    _, entry = layer_entry
    result = scan()
    stale = [m for m in entry.used_by if entry.name not in result.mentions.get(m, set())]
    assert not stale, (
        f"{entry.qualname} is listed as used by {stale}, which no longer mention it: drop or fix the entry"
    )
