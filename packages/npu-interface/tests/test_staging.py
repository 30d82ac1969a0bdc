# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``staging.staged_directory``: the final path holds the complete result or is as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_npu.interface.staging import staged_directory


def test_commit_renames_into_place_with_plain_mkdir_permissions(tmp_path: Path) -> None:
    final = tmp_path / "deep" / "out"
    with staged_directory(final) as staging:
        assert staging.parent == final.parent and staging.name.startswith(".out.partial-")
        (staging / "a").write_text("1")
        assert not final.exists()
    assert (final / "a").read_text() == "1"
    umask = os.umask(0)
    os.umask(umask)
    assert final.stat().st_mode & 0o777 == 0o777 & ~umask
    assert sorted(p.name for p in final.parent.iterdir()) == ["out"]


def test_non_empty_final_needs_replace_and_failure_keeps_it(tmp_path: Path) -> None:
    final = tmp_path / "out"
    final.mkdir()
    (final / "old").write_text("old")
    with pytest.raises(FileExistsError, match="exists and is not empty"), staged_directory(final) as staging:
        (staging / "new").write_text("new")
    with pytest.raises(RuntimeError), staged_directory(final, replace=True) as staging:
        (staging / "new").write_text("new")
        raise RuntimeError("mid-write")
    assert sorted(p.name for p in final.iterdir()) == ["old"]
    with staged_directory(final, replace=True) as staging:
        (staging / "new").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_leftovers_of_a_killed_writer_are_removed_by_the_next_one(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    leftover = tmp_path / f".out.partial-{pid}-0123abcd"
    leftover.mkdir()
    (leftover / "half").write_text("half-written")
    alive = tmp_path / f".out.partial-{os.getppid()}-0123abcd"  # a writer that is still running: kept
    alive.mkdir()
    with staged_directory(tmp_path / "out") as staging:
        (staging / "a").write_text("1")
    assert not leftover.exists() and alive.exists()
