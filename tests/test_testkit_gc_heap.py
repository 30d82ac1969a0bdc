# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The testkit's GC policy for in-process engines (npu_testkit.gc_heap): the heap alive when an engine starts is
frozen (full collections skip it), garbage is never frozen, and an engine's own reference cycles are still freed at
its teardown."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from npu_testkit import engine as engine_mod
from npu_testkit.gc_heap import freeze_long_lived_heap


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # leave the process as the other tests of this worker expect it


def test_freeze_collects_garbage_first_and_freezes_the_survivors(unfrozen: None) -> None:
    garbage, alive = _Node(), _Node()
    dead_ref = weakref.ref(garbage)
    del garbage
    count = freeze_long_lived_heap()
    assert dead_ref() is None, "garbage alive at the freeze must be collected, not frozen"
    assert count == gc.get_freeze_count() > 0
    assert gc.is_tracked(alive) and count > 0
    # the survivor sits in the permanent generation: a full collection no longer walks it
    assert not any(obj is alive for gen in range(3) for obj in gc.get_objects(gen))


def test_objects_created_after_the_freeze_are_collected(unfrozen: None) -> None:
    freeze_long_lived_heap()
    later = _Node()
    ref = weakref.ref(later)
    del later
    gc.collect()
    assert ref() is None


def test_engine_freezes_before_start_and_still_frees_the_engine(
    unfrozen: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    class FakeLLM:
        def __init__(self) -> None:
            self.cycle = _Node()
            self.me = self
            seen["freeze_count_at_start"] = gc.get_freeze_count()

    def fake_make_llm(model_dir: Any, **kwargs: Any) -> FakeLLM:
        return FakeLLM()

    monkeypatch.setattr(engine_mod, "make_llm", fake_make_llm)
    monkeypatch.setattr(engine_mod, "_cleanup_distributed", gc.collect)
    env = {"VLLM_RPC_BASE_PATH": str(tmp_path / "rpc")}
    with engine_mod.engine(tmp_path, env) as llm:
        refs = [weakref.ref(llm), weakref.ref(llm.cycle)]
        del llm
    assert seen["freeze_count_at_start"] > 0, "engine() must freeze the long-lived heap before the engine starts"
    assert [r() for r in refs] == [None, None], "the engine's reference cycles must be freed at teardown"
