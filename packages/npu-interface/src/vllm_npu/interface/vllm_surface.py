# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM surface: the private vLLM names (and a few public hooks) our layers override or read, and the check
that the installed vLLM still has each one with the signature it was written against.

vLLM does not promise anything about ``_``-names. A layer that overrides ``GPUModelRunner._sync_device`` keeps
working silently wrong when vLLM renames it (the override is dead code, vLLM's CUDA version runs); a layer that
calls ``VllmConfig._get_quantization_config`` fails at run time, far from the cause. So each layer lists what it
relies on, once, in ``vllm_npu/<layer>/_vllm_surface.py`` as ``SURFACE: tuple[VllmName, ...]`` (the table lives
with the code that relies on it: the layers are released separately), and :func:`check_surface` turns a vLLM bump
into one line per broken name. ``tests/test_vllm_surface.py`` runs the check against the installed vLLM and scans
``packages/*/src`` so that no private vLLM name is used without an entry.

Declaring an entry imports nothing; :func:`check_surface` imports the owners (vLLM) when it runs.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from .errors import LAYER_DISTRIBUTIONS
from .versions import distribution_version, release_key

#: How a layer relies on a name; ``method``: a function on a class (its signature is compared), ``attribute``: a
#: class attribute, ``instance_attribute``: an attribute vLLM's ``__init__`` (or another method) stores on ``self``,
#: ``module_global``: a module-level name.
Kind = Literal["method", "attribute", "instance_attribute", "module_global"]
KINDS: tuple[str, ...] = ("method", "attribute", "instance_attribute", "module_global")

#: What we do with the name, for the message: "vllm_npu.platform.model_runner overrides it".
Use = Literal["overrides", "calls", "reads", "writes"]
USES: tuple[str, ...] = ("overrides", "calls", "reads", "writes")

#: Where a layer declares its table (imported by :func:`installed_surface`).
SURFACE_MODULE = "vllm_npu.{layer}._vllm_surface"

#: In :attr:`VllmName.changes`: vLLM no longer has the name from that release on.
REMOVED = "<removed>"


@dataclass(frozen=True)
class VllmName:
    """One vLLM name a layer relies on.

    - ``owner``: ``"module:Class"`` (``"vllm.v1.worker.gpu_model_runner:GPUModelRunner"``) or, for a
      ``module_global``, the module (``"vllm.forward_context"``).
    - ``name``: the attribute, e.g. ``"_sync_device"``.
    - ``kind``: see :data:`Kind`.
    - ``use``: see :data:`Use`.
    - ``used_by``: the modules of ours that rely on it (``"vllm_npu.platform.model_runner"``).
    - ``signature``: for a ``method``, its parameters as :func:`signature_text` renders them on the owner in the
      vLLM this entry was written for (``"(self) -> None"`` is written ``"(self)"``: annotations are left out, they
      do not break an override or a call); ``None`` for the other kinds.
    - ``why``: what breaks, concretely, if the name changes.
    - ``changes``: how the entry differs in later releases of the line, as ``(first vLLM release, signature)``
      pairs in release order (``REMOVED``: absent from that release on). ``signature`` is the first release's
      (0.11.0); the code that relies on the name adapts to each change (one shim per seam, in the layer that owns it).
    - ``since``: the first release that has the name, when a later release of the line added it (``signature`` is
      then that release's); before it the entry expects the name absent.
    """

    owner: str
    name: str
    kind: Kind
    use: Use
    used_by: tuple[str, ...]
    why: str
    signature: str | None = None
    changes: tuple[tuple[str, str], ...] = ()
    since: str | None = None

    def __post_init__(self) -> None:
        where = f"vLLM surface entry {self.owner}.{self.name}"
        if self.kind not in KINDS:
            raise ValueError(f"{where}: kind {self.kind!r} must be one of {', '.join(KINDS)}")
        if self.use not in USES:
            raise ValueError(f"{where}: use {self.use!r} must be one of {', '.join(USES)}")
        if (self.kind == "module_global") == (":" in self.owner):
            raise ValueError(
                f"{where}: owner must be 'module:Class' for a {self.kind} and a plain module for a module_global"
            )
        if (self.kind == "method") != (self.signature is not None):
            raise ValueError(f"{where}: a method records its signature, the other kinds record none")
        if not self.used_by or not self.why.strip():
            raise ValueError(f"{where}: used_by and why are required")
        releases = [release_key(release) for release, _ in self.changes]
        if releases != sorted(releases) or len(set(releases)) != len(releases):
            raise ValueError(f"{where}: changes must be in release order, one per release")
        for release, value in self.changes:
            if value != REMOVED and self.kind != "method":
                raise ValueError(f"{where}: a {self.kind} records only its removal ({release}: {value!r})")

    def expected(self, vllm_version: str) -> str | None:
        """What this entry is on ``vllm_version``: its signature (None for the other kinds) or ``REMOVED``."""
        if self.since is not None and release_key(vllm_version) < release_key(self.since):
            return REMOVED
        current = self.signature
        for release, value in self.changes:
            if release_key(vllm_version) >= release_key(release):
                current = value
        return current

    @property
    def qualname(self) -> str:
        """``Class.name`` (or ``module.name``), the way messages name it."""
        return f"{self.owner.rpartition(':')[2] if ':' in self.owner else self.owner}.{self.name}"


def signature_text(obj: Any) -> str:
    """``obj``'s parameters without annotations: ``"(self, scheduler_output, intermediate_tensors=None)"``.

    Annotations are dropped because they vary with the Python version's rendering and with vLLM's typing clean-ups
    without changing what an override or a call needs; names, kinds (``*``, ``/``, ``**``) and defaults stay."""
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _resolve_owner(owner: str) -> Any:
    module_name, _, qual = owner.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qual.split(".") if qual else ():
        obj = getattr(obj, part)
    return obj


def _stores_on_self(cls: type, name: str) -> bool:
    """Whether the source of ``cls`` or of one of its bases assigns ``self.<name>``."""
    for klass in cls.__mro__:
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == name
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                return True
    return False


def _problem(entry: VllmName, vllm: str, what: str) -> str:
    users = " and ".join(entry.used_by)
    verb = entry.use if len(entry.used_by) == 1 else entry.use[:-1]
    table = SURFACE_MODULE.format(layer=entry.used_by[0].split(".")[1])
    return f"vLLM {vllm} {what}, which {users} {verb}: {entry.why} (adapt the code, then its entry in {table})"


def check_entry(entry: VllmName, *, vllm_version: str | None = None) -> str | None:
    """None if the installed vLLM has ``entry`` as recorded, else one line naming what changed and who relies on it."""
    vllm = vllm_version or distribution_version("vllm") or "(not installed)"
    expected = entry.expected(vllm)
    try:
        owner = _resolve_owner(entry.owner)
    except (ImportError, AttributeError) as exc:
        if expected == REMOVED:
            return None
        return _problem(entry, vllm, f"no longer has {entry.owner} ({type(exc).__name__}: {exc})")
    if entry.kind == "instance_attribute":
        present = hasattr(owner, entry.name) or (inspect.isclass(owner) and _stores_on_self(owner, entry.name))
    else:  # a class attribute may be declared only (``_enum: PlatformEnum``)
        present = hasattr(owner, entry.name) or entry.name in getattr(owner, "__annotations__", {})
    if expected == REMOVED:
        return (
            _problem(entry, vllm, f"has {entry.qualname} again, which the entry records as removed")
            if present
            else None
        )
    if not present:
        return _problem(entry, vllm, f"no longer has {entry.qualname}")
    if entry.kind == "method":
        value = getattr(owner, entry.name)
        if not callable(value):
            return _problem(entry, vllm, f"has {entry.qualname} but it is no longer callable")
        found = signature_text(value)
        if found != expected:
            return _problem(entry, vllm, f"changed the signature of {entry.qualname} from {expected} to {found}")
    return None


def check_surface(entries: Iterable[VllmName], *, vllm_version: str | None = None) -> list[str]:
    """One line per entry the installed vLLM no longer matches (empty = no drift)."""
    return [p for p in (check_entry(e, vllm_version=vllm_version) for e in entries) if p is not None]


def layer_surface(layer: str) -> tuple[VllmName, ...]:
    """The table of one layer (empty when the layer is absent or relies on no vLLM internals)."""
    module_name = SURFACE_MODULE.format(layer=layer)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return ()
        raise
    return tuple(module.SURFACE)


def installed_surface() -> dict[str, tuple[VllmName, ...]]:
    """Layer -> its table, for every installed layer that has one."""
    tables = {layer: layer_surface(layer) for layer in LAYER_DISTRIBUTIONS}
    return {layer: table for layer, table in tables.items() if table}


def import_moved(name: str, *modules: str) -> Any:
    """``name`` from the first of ``modules`` that has it: a public vLLM name that moved between releases of the
    line (newest location first), read from what is installed instead of keyed on the version. ImportError naming
    every place looked in when none has it."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(f"the installed vLLM has no {name} in any of {', '.join(modules)}")
