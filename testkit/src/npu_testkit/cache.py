# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The content-keyed build cache behind every checkpoint the testkit builds (``build_tiny_model``, the draft heads,
the MTP and Pangu checkpoints), safe when several processes ask for the same checkpoint at once.

pytest-xdist workers build the same tiny model at the same moment (e.g. two MTP modules sharing one target). A
builder writing straight into the cache directory lets another process see a marker before the weights are all
there, or read a shard while it is rewritten: the engine then loads garbage and fails (or, worse, answers wrong).
So a checkpoint is built in a private directory next to its final place, under an exclusive lock per checkpoint,
and moved into place with one ``rename`` after its ``.complete`` marker (which holds the content key) is written:
a directory at the final path either is complete or is not there, and each checkpoint is built once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

MARKER = ".complete"


def is_built(out: Path, key: str) -> bool:
    """Whether ``out`` holds a finished build of content ``key``."""
    marker = out / MARKER
    return marker.is_file() and marker.read_text() == key


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        yield


def cached_build(out: str | os.PathLike[str], key: str, build: Callable[[Path], None]) -> Path:
    """Return ``out`` holding the build of content ``key``: as it is when already built, else after
    ``build(staging_dir)`` wrote the checkpoint into an empty private directory that then replaces ``out``.

    Concurrent callers for the same ``out`` wait for the one that builds; a build that raises leaves ``out`` as it
    was. A stale ``out`` (another key, or no marker) is replaced."""
    out = Path(out)
    if is_built(out, key):
        return out
    with _locked(out):
        if is_built(out, key):  # built by another process while this one waited
            return out
        for leftover in out.parent.glob(f".{out.name}.build-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # a builder that died holding the lock
        staging = out.parent / f".{out.name}.build-{os.getpid()}"
        staging.mkdir()
        try:
            build(staging)
            (staging / MARKER).write_text(key)
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out
