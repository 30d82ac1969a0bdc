# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The testkit's checkpoint build cache (npu_testkit.cache) under concurrent builders, as pytest-xdist workers are:
one build per checkpoint, and no process ever sees a half-written checkpoint at its final path."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
from npu_testkit.cache import MARKER, cached_build, is_built


def _slow_build(staging: Path) -> None:
    # A build that writes its files over a while, as save_pretrained does; records who built.
    (staging / "part1").write_text("a")
    time.sleep(0.5)
    (staging / "part2").write_text("b")
    with open(staging.parent / "builds.log", "a") as log:
        log.write("built\n")


def _ask(out: str, seen: multiprocessing.Queue[tuple[bool, bool]]) -> None:
    path = cached_build(out, "k1", _slow_build)
    seen.put(((path / "part1").is_file(), (path / "part2").is_file()))


def test_concurrent_callers_build_once_and_see_only_a_complete_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "model-k1"
    ctx = multiprocessing.get_context("fork")  # the children only write files: no torch work after the fork
    seen: multiprocessing.Queue[tuple[bool, bool]] = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(str(out), seen)) for _ in range(3)]
    for p in procs:
        p.start()
    # Meanwhile: whenever the final path exists, it is complete.
    deadline = time.monotonic() + 60
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if out.exists():
            assert (out / "part2").is_file() and is_built(out, "k1")
        time.sleep(0.01)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [seen.get(timeout=5) for _ in procs] == [(True, True)] * 3
    assert (tmp_path / "builds.log").read_text() == "built\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model-k1.lock", "builds.log", "model-k1"]


def test_a_failed_build_leaves_nothing_and_a_stale_dir_is_replaced(tmp_path: Path) -> None:
    out = tmp_path / "model"

    def broken(staging: Path) -> None:
        (staging / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        cached_build(out, "k", broken)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [".model.lock"]

    out.mkdir()
    (out / "old").write_text("stale")  # an interrupted build of the old, unstaged kind: no marker
    built = cached_build(out, "k", lambda d: (d / "new").write_text("y"))
    assert sorted(p.name for p in built.iterdir()) == [MARKER, "new"]
    # a second call with the same key builds nothing
    assert cached_build(out, "k", broken) == out
