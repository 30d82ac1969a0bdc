# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A parent that starts one multiprocessing child and then waits forever (run by test_parent_watch.py).

``python _parent_watch_tree.py <start method> <child name> <child ignores SIGTERM: 0|1>``: the parent installs the
watch as the platform does, starts the child, prints the child's pid and sleeps. A spawned child installs the watch
itself (the platform hook runs in a spawned child); a forked child runs no plugin code and relies on the after-fork
hook.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time

from vllm_npu.platform import parent_watch


def child(ignore_term: bool, install: bool) -> None:
    parent_watch.GRACE_S = 1.0
    if ignore_term:  # a main thread that never runs Python signal handlers (stuck in a device call)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if install:
        parent_watch.install()
    while True:
        time.sleep(60)


if __name__ == "__main__":
    method, name, ignore = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    parent_watch.GRACE_S = 1.0
    parent_watch.install()  # in the parent ("MainProcess"): registers the after-fork hook, watches nothing
    ctx = multiprocessing.get_context(method)
    proc = ctx.Process(target=child, args=(ignore, method == "spawn"), name=name)
    proc.start()
    print(proc.pid, flush=True)
    while True:
        time.sleep(60)
