# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Timing shared by the reference-kernel benchmarks (each runs as a script, so this folder is on ``sys.path``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of one call of ``fn`` over ``repeats`` calls after one warm-up call, in milliseconds."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e3


def median_cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """:func:`median_ms` in this process's CPU time (``time.process_time``): on a loaded host wall time also counts
    the wait for a core; CPU time only the work done (run single-threaded, or it sums the threads)."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        runs.append(time.process_time() - t0)
    return statistics.median(runs) * 1e3
