# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The demo's cached checkpoint appears at its cache path complete or not at all (the training itself is replaced
by a stand-in that writes a few files: the real one is covered by tests/e2e/test_demo.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_npu.platform.tools.demo import checkpoint


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_NPU_CACHE_DIR", str(tmp_path))
    return tmp_path


def fake_training(*, fail: BaseException | None = None, exitcode: int = 0):
    def train(staging: Path) -> int:
        (staging / "model.safetensors").write_bytes(b"half")
        if fail is not None:
            raise fail
        if exitcode == 0:
            (staging / ".complete").write_text("key")
        return exitcode

    return train


@pytest.mark.parametrize(
    ("fail", "exitcode"),
    [(None, 1), (KeyboardInterrupt(), 0), (RuntimeError("trainer crashed"), 0)],
    ids=["child-failed", "ctrl-c", "error"],
)
def test_a_failed_build_leaves_nothing_at_the_cache_path(
    cache: Path, monkeypatch: pytest.MonkeyPatch, fail: BaseException | None, exitcode: int
) -> None:
    monkeypatch.setattr(checkpoint, "_train", fake_training(fail=fail, exitcode=exitcode))
    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        checkpoint.ensure_demo_model()
    assert list(cache.iterdir()) == []  # neither the checkpoint directory nor a staging directory


def test_build_then_reuse_and_an_incomplete_leftover_is_rebuilt(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = checkpoint.demo_model_dir()
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"torn")  # an older plugin trained in place and was killed
    monkeypatch.setattr(checkpoint, "_train", fake_training())
    assert checkpoint.ensure_demo_model() == (out, True)
    assert (out / "model.safetensors").read_bytes() == b"half" and (out / ".complete").is_file()
    monkeypatch.setattr(checkpoint, "_train", fake_training(fail=AssertionError("not trained again")))
    assert checkpoint.ensure_demo_model() == (out, False)
    assert [p.name for p in cache.iterdir()] == [out.name]


def test_a_concurrent_build_that_finished_first_is_kept(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = checkpoint.demo_model_dir()

    def train_while_another_finishes(staging: Path) -> int:
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"theirs")
        (out / ".complete").write_text("key")
        return fake_training()(staging)

    monkeypatch.setattr(checkpoint, "_train", train_while_another_finishes)
    assert checkpoint.ensure_demo_model() == (out, True)
    assert (out / "model.safetensors").read_bytes() == b"theirs"
    assert [p.name for p in cache.iterdir()] == [out.name]


def test_demo_reports_the_graph_mode_that_ran():
    from vllm_npu.platform.tools.demo import graph_mode

    assert graph_mode({"cudagraph_mode": "NONE", "capture_sizes": []}) == "eager (no graphs)"
    compiled = {
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "capture_sizes": [1, 2],
        "graphs": {
            "compiled": {"FULL": 2},
            "compile_seconds": {"FULL": 3.0},
            "replays": {"FULL": 40},
            "pieces": {"compiles": 3, "disk_hits": 2},
        },
    }
    assert graph_mode(compiled) == (
        "FULL_DECODE_ONLY graphs, capture sizes [1, 2], compiled replay (3 compiles, 2 from the on-disk cache, 3.0 s), "
        "40 replays"
    )
    uncompiled = {"cudagraph_mode": "PIECEWISE", "capture_sizes": [4], "graphs": {"replays": {"PIECEWISE": 5}}}
    assert graph_mode(uncompiled) == "PIECEWISE graphs, capture sizes [4], 5 replays"
