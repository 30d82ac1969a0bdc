# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Write a directory all at once: every command of the plugin that writes a directory a user (or vLLM) will read
builds it in a private sibling and moves it into place with one ``rename``.

A crash, an exception or Ctrl-C while writing therefore never leaves a half-written directory at the final path and
never touches what was there before: the final path either holds the complete result or is as it was. The sibling is
on the same file system (same parent directory), so the rename is atomic. A process killed with SIGKILL cannot clean
up after itself: its hidden sibling (``.<name>.partial-<pid>-<random>``) stays behind and is removed by the next
writer of the same path once that pid is gone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

_PARTIAL = ".partial-"
_OLD = ".old-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove_dead_leftovers(final: Path) -> None:
    """Remove staging siblings of ``final`` left by writers that died (their pid is no longer running)."""
    for marker in (_PARTIAL, _OLD):
        for leftover in final.parent.glob(f".{final.name}{marker}*"):
            pid = leftover.name[len(f".{final.name}{marker}") :].partition("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(leftover, ignore_errors=True)


def _sibling(final: Path, marker: str) -> Path:
    return final.parent / f".{final.name}{marker}{os.getpid()}-{secrets.token_hex(4)}"


def is_empty_dir(path: Path) -> bool:
    """Whether ``path`` is a directory with nothing in it."""
    return path.is_dir() and next(path.iterdir(), None) is None


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike[str], *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty private directory beside ``final``; when the block ends normally it becomes ``final``.

    ``final`` may be absent or an empty directory. A non-empty ``final`` is replaced only with ``replace=True``
    (moved aside, the new directory renamed in, the old one then deleted); without it the commit raises
    :class:`FileExistsError` and the staged result is discarded. When the block raises (``KeyboardInterrupt``
    included), the staging directory is deleted and ``final`` is untouched. Missing parent directories of ``final``
    are created. The staging directory gets the permissions a plain ``mkdir`` would (the umask applies).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_leftovers(final)
    staging = _sibling(final, _PARTIAL)
    staging.mkdir()
    try:
        yield staging
        _commit(staging, final, replace=replace)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _commit(staging: Path, final: Path, *, replace: bool) -> None:
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise FileExistsError(f"{final} exists and is not a directory; it was left as it was")
    if not final.exists():
        staging.rename(final)
        return
    if is_empty_dir(final):
        final.rmdir()
        staging.rename(final)
        return
    if not replace:
        raise FileExistsError(f"{final} exists and is not empty; it was left as it was")
    old = _sibling(final, _OLD)
    final.rename(old)
    try:
        staging.rename(final)
    except BaseException:
        old.rename(final)  # put the previous content back
        raise
    shutil.rmtree(old, ignore_errors=True)
