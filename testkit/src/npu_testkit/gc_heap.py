# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The long-lived heap of a test process, kept out of the garbage collector's full passes.

A pytest worker that has imported vLLM, torch and transformers holds ~700 000 objects that live until it exits
(modules, classes, functions, constants). Every full ``gc.collect()`` walks all of them: ~1 CPU-second each on the
2-core CI machine (2-7 s of wall time under the suite's load). An in-process engine's start-up and teardown call it
six times (vLLM's ``DeviceMemoryProfiler`` around ``load_model``: three; ``cleanup_dist_env_and_memory`` and the
testkit's teardown: three), so ~6 CPU-seconds of every engine module went to re-scanning the import heap.

vLLM's own engine-core process does the same thing at the end of its start-up (``EngineCoreProc.__init__``:
``gc.collect(); gc.freeze()``, "mark the startup heap as static"); the in-process engine core the tests use never
runs that code. :func:`freeze_long_lived_heap` is that step for the test process, taken before each engine starts:

- collect first, so no garbage is frozen (nothing unreachable at that moment is kept alive);
- then ``gc.freeze()``: the surviving objects move to the permanent generation, which collections skip;
- objects created afterwards (the engine, its model, its KV cache, a test's data) are collected exactly as before,
  so an engine's reference cycles are still freed at its teardown (tests/test_testkit_gc_heap.py checks this).

A frozen object that later becomes cyclic garbage is only freed at the next ``gc.unfreeze()`` (the model runner's
graph capture calls it, as vLLM's does); the objects alive between two engine modules are the imports and the
session fixtures, which live to the end of the process anyway.
"""

from __future__ import annotations

import gc


def freeze_long_lived_heap() -> int:
    """Collect garbage, then freeze every object still alive (``gc.freeze``). Returns the permanent generation's
    size (``gc.get_freeze_count()``) after the freeze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
