# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The patch registry: THE way any vllm-npu layer monkey-patches vLLM.

Rules it enforces (OTel ``BaseInstrumentor`` style, one state machine per patch):

- applying is idempotent: an applied patch is never applied twice;
- applying is reversible: the attribute exactly as stored on its owner is kept, and revert puts that very object
  back (or deletes the override when the attribute was inherited);
- outside its vLLM range a patch is skipped with a logged reason; inside it, every fingerprint is verified before
  anything changes, and a mismatch raises :class:`PatchFingerprintError` naming the patch and the target;
- ``VLLM_NPU_PATCHES`` (``all`` | ``none`` | ``-<id>,...``) and ``--additional-config '{"npu": {"disabled_patches":
  [...]}}'`` disable patches by id; an unknown id is a :class:`ConfigError` listing the known ids.

Other layers add patches with :func:`register_patch` (or the ``vllm_npu.patches`` entry-point group, whose entries
name an iterable of :class:`Patch`). A patch registered after its scope was applied in this process is applied at
once, with the same settings.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.metadata
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_npu.interface import (
    ENV_PATCHES,
    AdditionalConfig,
    ConfigError,
    EnvConfig,
    Scope,
    distribution_version,
    get_logger,
    in_range,
)

from ._errors import PatchError, PatchFingerprintError
from ._model import Patch, Target, fingerprint_of, resolve

logger = get_logger(__name__)

#: Entry-point group through which other distributions declare patches (value: ``module:ITERABLE_OF_PATCHES``).
PATCH_ENTRY_POINT_GROUP = "vllm_npu.patches"

#: Attribute set on replacement functions, naming the patch that installed them (for diagnostics and tests).
MARKER = "__vllm_npu_patch__"

_ALL = "*"


class PatchStatus(str, enum.Enum):
    PENDING = "pending"  # registered; its scope was not applied in this process (yet)
    APPLIED = "applied"
    SKIPPED = "skipped"  # vLLM outside the patch's range
    DISABLED = "disabled"  # VLLM_NPU_PATCHES or additional_config.npu.disabled_patches
    REVERTED = "reverted"


@dataclass
class PatchRecord:
    """One patch and its state in this process."""

    patch: Patch
    status: PatchStatus = PatchStatus.PENDING
    reason: str = ""
    _target: Target | None = field(default=None, repr=False)
    _original: Any = field(default=None, repr=False)
    _had_own: bool = field(default=False, repr=False)
    _replacement: Any = field(default=None, repr=False)

    @property
    def id(self) -> str:
        return self.patch.id

    @property
    def original(self) -> Any:
        """The attribute as stored before the patch (only meaningful once applied)."""
        return self._original


@dataclass(frozen=True)
class _Settings:
    disabled: frozenset[str]
    vllm_version: str | None
    sources: Mapping[str, str]  # disabled id -> where it was disabled


class PatchRegistry:
    """An ordered set of patches and their per-process state. Thread-safe."""

    def __init__(self, patches: Iterable[Patch] = ()) -> None:
        self._lock = threading.RLock()
        self._records: dict[str, PatchRecord] = {}
        self._opened: dict[Scope, _Settings] = {}
        for patch in patches:
            self.register(patch)

    # -- declaring ---------------------------------------------------------------------------------------------
    def register(self, patch: Patch) -> Patch:
        """Add ``patch``. Registering an equal patch again is a no-op; a different patch with a used id is an error.

        If ``patch.scope`` was already applied in this process, the patch is applied now with the same settings.
        """
        if not isinstance(patch, Patch):
            raise PatchError(f"register_patch() takes a Patch, got {type(patch).__name__}")
        with self._lock:
            known = self._records.get(patch.id)
            if known is not None:
                if known.patch == patch:
                    return patch
                raise PatchError(
                    f"patch id {patch.id!r} is already registered (target {known.patch.target}, layer "
                    f"{known.patch.layer}); pick another id for {patch.target}"
                )
            self._records[patch.id] = PatchRecord(patch)
            settings = self._opened.get(patch.scope)
            if settings is not None:
                self._apply_records([self._records[patch.id]], settings)
        return patch

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def patches(self, scope: Scope | str | None = None) -> list[Patch]:
        scope = Scope(scope) if scope is not None else None
        with self._lock:
            return [r.patch for r in self._records.values() if scope is None or r.patch.scope is scope]

    def get(self, patch_id: str) -> Patch:
        with self._lock:
            if patch_id not in self._records:
                raise PatchError(f"unknown patch id {patch_id!r}; known ids: {', '.join(self._records) or '(none)'}")
            return self._records[patch_id].patch

    def record(self, patch_id: str) -> PatchRecord:
        self.get(patch_id)
        return self._records[patch_id]

    def records(self) -> list[PatchRecord]:
        with self._lock:
            return list(self._records.values())

    # -- settings ----------------------------------------------------------------------------------------------
    def disabled_ids(
        self, *, environ: Mapping[str, str] | None = None, vllm_config: Any | None = None
    ) -> tuple[frozenset[str], dict[str, str]]:
        """The ids disabled by ``VLLM_NPU_PATCHES`` and ``additional_config["npu"]["disabled_patches"]``.

        Returns ``(ids, {id: source})``; ``"*"`` in ids means every patch. Unknown ids raise ConfigError.
        """
        sources: dict[str, str] = {}
        env = EnvConfig.from_environ(environ)
        for pid in env.disabled_patches:
            sources[pid] = f"{ENV_PATCHES}={env.PATCHES}"
        if vllm_config is not None:
            extra = AdditionalConfig.from_vllm(getattr(vllm_config, "additional_config", None))
            for pid in extra.disabled_patches:
                sources.setdefault(pid, "--additional-config npu.disabled_patches")
        known = set(self.ids())
        unknown = sorted(pid for pid in sources if pid != _ALL and pid not in known)
        if unknown:
            where = sorted({sources[pid] for pid in unknown})
            raise ConfigError(
                f"{' and '.join(where)} names unknown patch id(s) {', '.join(repr(u) for u in unknown)}; "
                f"known ids: {', '.join(sorted(known)) or '(none)'} (see `vllm-npu patches`)"
            )
        return frozenset(sources), sources

    # -- evaluating --------------------------------------------------------------------------------------------
    def plan(
        self,
        patch_id: str,
        *,
        disabled: frozenset[str] = frozenset(),
        sources: Mapping[str, str] | None = None,
        vllm_version: str | None = None,
        check_fingerprints: bool = True,
    ) -> tuple[PatchStatus, str]:
        """What applying ``patch_id`` here would do, without changing anything: (status, reason).

        ``disabled`` and ``sources`` are what :meth:`disabled_ids` returns (``sources`` names the setting in the
        reason of a disabled patch). A fingerprint mismatch is reported as ``(PENDING, "fingerprint mismatch: ...")``
        rather than raised.
        """
        rec = self.record(patch_id)
        if rec.status is PatchStatus.APPLIED:
            return PatchStatus.APPLIED, "applied in this process"
        status, reason = self._gate(rec.patch, disabled, sources or {}, vllm_version)
        if status is not None:
            return status, reason
        if check_fingerprints:
            try:
                self._verify(rec.patch, vllm_version)
            except PatchFingerprintError as exc:
                return PatchStatus.PENDING, f"fingerprint mismatch: {exc}"
            except PatchError as exc:
                return PatchStatus.PENDING, f"error: {exc}"
        return PatchStatus.PENDING, f"applies at {rec.patch.scope.value} scope"

    @staticmethod
    def _gate(
        patch: Patch, disabled: frozenset[str], sources: Mapping[str, str], version: str | None
    ) -> tuple[PatchStatus | None, str]:
        if _ALL in disabled or patch.id in disabled:
            src = sources.get(patch.id) or sources.get(_ALL) or f"{ENV_PATCHES}"
            return PatchStatus.DISABLED, f"disabled by {src}"
        if version is None:
            return PatchStatus.SKIPPED, "vLLM is not installed"
        if not in_range(version, patch.vllm, what=f"patch {patch.id} vllm range"):
            return PatchStatus.SKIPPED, f"vLLM {version} is outside the patch's range {patch.vllm!r}"
        return None, ""

    @staticmethod
    def _verify(patch: Patch, version: str | None) -> Target:
        target = resolve(patch.target)
        for path, expected in patch.fingerprints_for(version):
            obj = target.raw() if path == patch.target else resolve(path).raw()
            found = fingerprint_of(obj)
            if found != expected:
                raise PatchFingerprintError(patch.id, path, expected, found, version)
        return target

    # -- applying ----------------------------------------------------------------------------------------------
    def apply(
        self,
        scope: Scope | str,
        *,
        vllm_config: Any | None = None,
        environ: Mapping[str, str] | None = None,
        vllm_version: str | None = None,
    ) -> list[PatchRecord]:
        """Apply every registered patch of ``scope`` that is enabled and in range. Returns the scope's records.

        All fingerprints are verified before any attribute changes, so a mismatch leaves vLLM untouched.
        """
        scope = Scope(scope)
        disabled, sources = self.disabled_ids(environ=environ, vllm_config=vllm_config)
        version = vllm_version if vllm_version is not None else distribution_version("vllm")
        settings = _Settings(disabled, version, sources)
        with self._lock:
            records = [r for r in self._records.values() if r.patch.scope is scope]
            self._apply_records(records, settings)
            self._opened[scope] = settings
            return records

    def _apply_records(self, records: list[PatchRecord], settings: _Settings) -> None:
        todo: list[tuple[PatchRecord, Target]] = []
        for rec in records:
            if rec.status is PatchStatus.APPLIED:
                continue
            status, reason = self._gate(rec.patch, settings.disabled, settings.sources, settings.vllm_version)
            if status is not None:
                if (rec.status, rec.reason) != (status, reason):
                    logger.info("patch %s (%s) not applied: %s", rec.id, rec.patch.target, reason)
                rec.status, rec.reason = status, reason
                continue
            todo.append((rec, self._verify(rec.patch, settings.vllm_version)))
        for rec, target in todo:
            self._apply_one(rec, target)

    @staticmethod
    def _apply_one(rec: PatchRecord, target: Target) -> None:
        original = target.raw()
        replacement = rec.patch.make_replacement(original)
        with contextlib.suppress(AttributeError, TypeError):  # e.g. a builtin: the registry record still knows
            setattr(replacement, MARKER, rec.id)
        had_own = target.own
        setattr(target.owner, target.name, replacement)
        rec._target, rec._original, rec._had_own, rec._replacement = target, original, had_own, replacement
        rec.status, rec.reason = PatchStatus.APPLIED, f"applied at {rec.patch.scope.value} scope"
        logger.info("applied patch %s to %s", rec.id, rec.patch.target)

    # -- reverting ---------------------------------------------------------------------------------------------
    def revert(self, scope: Scope | str | None = None, ids: Iterable[str] | None = None) -> list[str]:
        """Undo applied patches (all, one scope, or the given ids), newest first. Returns the ids reverted.

        Refuses (PatchError) to revert a target that someone replaced again after our patch.
        """
        scope = Scope(scope) if scope is not None else None
        wanted = set(ids) if ids is not None else None
        if wanted is not None:
            for pid in wanted:
                self.get(pid)
        done = []
        with self._lock:
            for rec in reversed(list(self._records.values())):
                if rec.status is not PatchStatus.APPLIED:
                    continue
                if (scope is not None and rec.patch.scope is not scope) or (
                    wanted is not None and rec.id not in wanted
                ):
                    continue
                self._revert_one(rec)
                done.append(rec.id)
            if scope is None and wanted is None:
                self._opened.clear()
            elif scope is not None and wanted is None:
                self._opened.pop(scope, None)
        return done

    @staticmethod
    def _revert_one(rec: PatchRecord) -> None:
        target = rec._target
        assert target is not None
        current = target.raw() if target.own else None
        if current is not rec._replacement:
            raise PatchError(
                f"patch {rec.id!r}: {rec.patch.target} was replaced by something else after the patch was applied "
                f"(now {current!r}); refusing to revert over it"
            )
        if rec._had_own:
            setattr(target.owner, target.name, rec._original)
        else:
            delattr(target.owner, target.name)
        rec.status, rec.reason = PatchStatus.REVERTED, "reverted"
        rec._target = rec._original = rec._replacement = None
        logger.info("reverted patch %s on %s", rec.id, rec.patch.target)


# -- the process-wide registry -----------------------------------------------------------------------------------

_default: list[PatchRegistry] = []  # a 1-slot holder, filled on first use
_default_lock = threading.Lock()


def _declared_patches() -> list[Patch]:
    """The built-in set plus the patches other distributions declare through the entry-point group."""
    from .sets import BUILTIN_PATCHES

    found: list[Patch] = list(BUILTIN_PATCHES)
    for ep in importlib.metadata.entry_points(group=PATCH_ENTRY_POINT_GROUP):
        try:
            declared = list(ep.load())
        except Exception as exc:  # a broken third-party declaration names itself, never hides the others
            raise PatchError(
                f"entry point {ep.name!r} ({ep.value}) in {PATCH_ENTRY_POINT_GROUP} failed to load: {exc}"
            ) from exc
        found.extend(declared)
    return found


def get_registry() -> PatchRegistry:
    """The process-wide registry, holding the built-in patches and every declared one."""
    with _default_lock:
        if not _default:
            _default.append(PatchRegistry(_declared_patches()))
        return _default[0]


def register_patch(patch: Patch) -> Patch:
    """Register ``patch`` in the process-wide registry (see :meth:`PatchRegistry.register`)."""
    return get_registry().register(patch)


def apply_patches(
    scope: Scope | str, *, vllm_config: Any | None = None, environ: Mapping[str, str] | None = None
) -> list[PatchRecord]:
    """Apply the process-wide registry's patches of ``scope`` (see :meth:`PatchRegistry.apply`)."""
    return get_registry().apply(scope, vllm_config=vllm_config, environ=environ)


def revert_patches(scope: Scope | str | None = None, ids: Iterable[str] | None = None) -> list[str]:
    """Revert applied patches of the process-wide registry (see :meth:`PatchRegistry.revert`)."""
    return get_registry().revert(scope, ids)


def patch_status() -> dict[str, tuple[PatchStatus, str]]:
    """``{id: (status, reason)}`` for every patch of the process-wide registry, in registration order."""
    return {r.id: (r.status, r.reason) for r in get_registry().records()}


def patch_report(_worker: Any = None) -> dict[str, dict[str, Any]]:
    """Every patch of this process: ``{id: {"status", "reason", "target", "scope", "installed"}}``.

    ``installed`` says whether the target currently holds this patch's replacement. The ignored first argument
    lets ``llm.collective_rpc(patch_report)`` run it in every worker (vLLM passes the worker; the function is
    importable, so it crosses process boundaries).
    """
    out: dict[str, dict[str, Any]] = {}
    for rec in get_registry().records():
        installed = False
        if rec.status is PatchStatus.APPLIED:
            try:
                installed = getattr(resolve(rec.patch.target).raw(), MARKER, None) == rec.id
            except PatchError:
                installed = False
        out[rec.id] = {
            "status": rec.status.value,
            "reason": rec.reason,
            "target": rec.patch.target,
            "scope": rec.patch.scope.value,
            "installed": installed,
        }
    return out
