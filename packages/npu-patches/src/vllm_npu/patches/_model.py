# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The patch model: what one monkey-patch of vLLM declares, how its target is found and fingerprinted.

A :class:`Patch` is pure data (strings), so declaring one imports nothing: the target and the replacement are
resolved only when the patch is checked or applied.

Fingerprint: ``sha256`` of ``ast.dump`` of the target's source (``inspect.getsource``, dedented), with docstrings
removed. Going through the AST makes the fingerprint blind to comments, docstrings, blank lines and formatting, and
sensitive to everything that runs. Objects without Python source (constants, builtins) are fingerprinted by ``repr``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import re
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_npu.interface import Scope, import_target, in_range, parse_range, release_key

from ._errors import PatchError

_ID = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

#: The fingerprint a release of :attr:`Patch.changes` gives a path it no longer checks (the code moved or went away).
NOT_CHECKED = "not-checked"


@dataclass(frozen=True)
class Patch:
    """One monkey-patch of vLLM.

    - ``id``: kebab-case, unique; the name used by ``VLLM_NPU_PATCHES=-<id>`` and ``disabled_patches``.
    - ``target``: dotted path of the attribute replaced, e.g. ``"vllm.attention.layer.Attention.forward"`` (vLLM,
      or a library vLLM runs on, such as torch).
    - ``replacement``: ``"module:function"`` of a factory ``f(original) -> new`` building the new attribute from
      the original one (resolved lazily, so declaring a patch imports nothing).
    - ``scope``: ``platform`` = every process where our platform is active, at plugin load; ``worker`` = each
      worker process, at worker init.
    - ``vllm``: PEP 440 range of vLLM versions that need the patch; outside it the patch is skipped with a log line.
    - ``fingerprint``: sha256 (see :func:`fingerprint_of`) of the target in the vLLM the patch was written for.
    - ``also_checks``: other dotted paths whose code the patch relies on, each with its fingerprint (e.g. the
      caller that looks the target up at call time).
    - ``upstream``: the vLLM PR or issue (a URL), or ``"none: <why>"``.
    - ``reason``: the behaviour that fails (or costs) without the patch, stated concretely.
    - ``removal``: when and how the patch goes away.
    - ``layer``: the vllm-npu layer that contributed the patch (``"patches"`` for the built-in set).
    - ``changes``: later releases of the range whose code differs from the first one's, each reviewed (the patch is
      still needed and still right there): ``(first vLLM release, ((dotted path, fingerprint), ...))`` in release
      order; from that release on those fingerprints replace the earlier ones (see :meth:`fingerprints_for`). A
      release may check a path the earlier ones do not (code that moved there or is new) and stop checking one
      (:data:`NOT_CHECKED` as its fingerprint: the code moved or went away).
    """

    id: str
    target: str
    replacement: str
    scope: Scope
    vllm: str
    fingerprint: str
    upstream: str
    reason: str
    removal: str
    also_checks: tuple[tuple[str, str], ...] = field(default=())
    layer: str = "patches"
    changes: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = field(default=())

    def __post_init__(self) -> None:
        where = f"patch {self.id!r}"
        if not _ID.match(self.id):
            raise PatchError(f"{where}: an id must be kebab-case ([a-z0-9] words joined by '-')")
        if not isinstance(self.scope, Scope):
            # the string form ("worker") from untyped callers, e.g. entry-point patch sets
            object.__setattr__(self, "scope", _scope(self.scope, where))  # type: ignore[unreachable]
        if self.target.count(".") < 1 or not all(part.isidentifier() for part in self.target.split(".")):
            raise PatchError(f"{where}: target {self.target!r} must be a dotted path like vllm.<module>.<attr>")
        if ":" not in self.replacement:
            raise PatchError(f"{where}: replacement {self.replacement!r} must look like 'package.module:factory'")
        try:
            parse_range(self.vllm, what=f"{where} vllm range")
        except ValueError as exc:
            raise PatchError(str(exc)) from None
        checks = self.also_checks.items() if isinstance(self.also_checks, Mapping) else self.also_checks
        object.__setattr__(self, "also_checks", tuple((str(p), str(f)) for p, f in checks))
        checked = {path for path, _ in self.fingerprints}
        releases = [release_key(release) for release, _ in self.changes]
        if releases != sorted(releases) or len(set(releases)) != len(releases):
            raise PatchError(f"{where}: changes must be in release order, one per release")
        for release, prints in self.changes:
            if not in_range(release, self.vllm, what=f"{where} vllm range"):
                raise PatchError(f"{where}: changes names vLLM {release}, outside the patch's range {self.vllm!r}")
            dropped = {path for path, fp in prints if fp == NOT_CHECKED}
            if self.target in dropped or dropped - checked:
                raise PatchError(
                    f"{where}: changes of {release} stop checking {sorted(dropped)}, which must be paths checked "
                    f"before {release} and not the target (a patch whose target went away needs a new range)"
                )
            checked = (checked | {path for path, _ in prints}) - dropped
        later = [(path, fp) for _, prints in self.changes for path, fp in prints if fp != NOT_CHECKED]
        for path, fp in (*self.fingerprints, *later):
            if not _HEX64.match(fp):
                raise PatchError(f"{where}: fingerprint of {path} must be 64 lowercase hex digits (sha256), got {fp!r}")
        for name in ("upstream", "reason", "removal"):
            if not getattr(self, name).strip():
                raise PatchError(f"{where}: {name} must be stated (no patch without a reason and a removal plan)")

    @property
    def fingerprints(self) -> tuple[tuple[str, str], ...]:
        """Every (dotted path, expected fingerprint) the patch verifies before applying: the target first."""
        return ((self.target, self.fingerprint), *self.also_checks)

    def fingerprints_for(self, vllm_version: str | None) -> tuple[tuple[str, str], ...]:
        """:attr:`fingerprints` as the patch expects them on ``vllm_version`` (``changes`` applied up to it)."""
        expected = dict(self.fingerprints)
        for release, prints in self.changes:
            if vllm_version is not None and release_key(vllm_version) >= release_key(release):
                expected.update(prints)
        return tuple((path, fp) for path, fp in expected.items() if fp != NOT_CHECKED)

    def make_replacement(self, original: Any) -> Any:
        """Build the object that replaces ``original`` (imports the replacement module)."""
        factory: Callable[[Any], Any] = import_target(self.replacement, what=f"replacement factory of patch {self.id}")
        return factory(original)


def _scope(value: Any, where: str) -> Scope:
    try:
        return Scope(value)
    except ValueError:
        raise PatchError(f"{where}: scope {value!r} must be one of {[s.value for s in Scope]}") from None


@dataclass(frozen=True)
class Target:
    """A resolved dotted path: ``owner.<name>``, with the raw attribute as stored on the owner (if it is there)."""

    path: str
    owner: Any
    name: str

    @property
    def own(self) -> bool:
        """Whether the attribute lives in the owner's own ``__dict__`` (False = inherited or absent)."""
        return self.name in _own_dict(self.owner)

    def raw(self) -> Any:
        """The attribute exactly as stored (``staticmethod``/``classmethod`` objects are kept, not unwrapped)."""
        own = _own_dict(self.owner)
        if self.name in own:
            return own[self.name]
        return inspect.getattr_static(self.owner, self.name)

    def value(self) -> Any:
        """The attribute as seen through normal lookup."""
        return getattr(self.owner, self.name)


def _own_dict(obj: Any) -> Mapping[str, Any]:
    return vars(obj) if hasattr(obj, "__dict__") else {}


def resolve(path: str) -> Target:
    """Resolve ``"pkg.module.Class.attr"``: import the longest importable module prefix, then walk attributes."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise  # the module exists but one of ITS imports is missing: a real error, not a shorter prefix
            continue
        try:
            for attr in parts[cut:-1]:
                obj = getattr(obj, attr)
        except AttributeError:
            raise PatchError(
                f"cannot resolve {path}: {module_name} has no attribute path {'.'.join(parts[cut:-1])}"
            ) from None
        if not hasattr(obj, parts[-1]):
            raise PatchError(f"cannot resolve {path}: {'.'.join(parts[:-1])} has no attribute {parts[-1]!r}")
        return Target(path, obj, parts[-1])
    raise PatchError(f"cannot resolve {path}: no importable module prefix")


def _unwrap(obj: Any) -> Any:
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    if isinstance(obj, property):
        return obj.fget
    return obj


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return tree


def _drop_empty_type_params(tree: ast.AST) -> ast.AST:
    """Python 3.12 added ``type_params`` (PEP 695) to function and class nodes, which ``ast.dump`` prints even when
    empty; without it the same source would fingerprint differently on 3.12 than on 3.10/3.11. Dropping the empty
    field gives every supported Python the 3.10 dump (a non-empty one is real code and stays)."""
    for node in ast.walk(tree):
        if getattr(node, "type_params", None) == []:
            delattr(node, "type_params")  # not in the 3.10 AST that mypy checks against
    return tree


def fingerprint_of(obj: Any) -> str:
    """sha256 of the normalised source of ``obj`` (see the module docstring). Stable across formatting, comment and
    docstring changes and across Python 3.10-3.12; any change to the code itself changes it."""
    obj = _unwrap(obj)
    try:
        source = textwrap.dedent(inspect.getsource(obj))
        tree = _drop_empty_type_params(_strip_docstrings(ast.parse(source)))
        text = ast.dump(tree, annotate_fields=True, include_attributes=False)
    except (OSError, TypeError, SyntaxError):
        text = f"repr:{obj!r}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint_path(path: str) -> str:
    """The fingerprint of the object at dotted ``path`` (as stored on its owner)."""
    return fingerprint_of(resolve(path).raw())
