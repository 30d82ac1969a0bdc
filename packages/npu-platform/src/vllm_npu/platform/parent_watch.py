# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The processes vLLM starts for an engine exit when their parent dies, on every device: on an NPU they would hold
device memory (weights, KV cache) until someone finds and kills them.

vLLM 0.11 leaves them running. The engine-core process (``EngineCore_DP<n>``, a child of the API server or of the
``LLM`` process) has no parent monitoring at all: ``kill -9`` of ``vllm serve`` leaves it blocked on its input queue
with the model loaded, and with it every worker it started. The multiprocessing workers (``VllmWorker-<n>``) do
watch the engine core through a death pipe, but only set an event that ``worker_busy_loop`` checks between RPCs: a
worker still loading the model, or inside a collective or a long kernel, never sees it.

So every process whose multiprocessing name is one vLLM gives an engine process (:data:`VLLM_CHILD_PREFIXES`)
watches the parent that started it from a daemon thread: a ``pidfd`` of the parent (Linux 5.3+) becomes readable when
the parent exits, and where there is none (older kernels, seccomp, macOS) the thread polls ``os.getppid()``.
``prctl(PR_SET_PDEATHSIG)`` is not used: it fires when the parent *thread* that forked the child exits, not the
parent process, and vLLM starts processes from helper threads too. When the parent is gone the process sends
itself SIGTERM, so vLLM's own handler runs its ordinary shutdown (the engine core stops its executor and workers),
and SIGKILL if it is still alive :data:`GRACE_S` seconds later (a main thread stuck in a device call never runs a
Python signal handler); its own children then see their parent die and do the same.

:func:`install` runs where the platform activates (``vllm_npu.platform.register``, called in every process vLLM
starts with ``spawn``); for ``fork`` it also registers a multiprocessing after-fork hook, since a forked child
re-runs no plugin code and only gets its name in ``Process._bootstrap``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import select
import signal
import threading
import time

from vllm_npu.interface import get_logger

#: multiprocessing names vLLM 0.11 gives the processes it starts: the engine core (vllm/v1/engine/utils.py
#: CoreEngineProcManager), multiprocessing workers (vllm/v1/executor/multiproc_executor.py), API server processes
#: of ``--api-server-count`` (vllm/v1/utils.py APIServerProcessManager) and the data-parallel coordinator
#: (vllm/v1/engine/coordinator.py).
VLLM_CHILD_PREFIXES = ("EngineCore_", "VllmWorker-", "ApiServer_", "VLLM_DP_Coordinator")
#: Seconds between the SIGTERM a process sends itself and the SIGKILL that follows if it is still alive.
GRACE_S = 10.0
#: Seconds between two ``os.getppid()`` checks where the parent cannot be watched through a pidfd.
POLL_S = 0.5

logger = get_logger(__name__)

_lock = threading.Lock()
_watched: int | None = None  # pid of the parent this process watches (None: not watching)


class _AfterForkToken:
    """multiprocessing keeps after-fork callbacks in a weak dictionary keyed by a live object: this one."""


_TOKEN = _AfterForkToken()
_registered = False


def install() -> None:
    """Watch the parent now if this is a vLLM engine process, and in every multiprocessing child forked later.
    Idempotent; never raises (it runs on vLLM's platform-plugin path)."""
    global _registered
    try:
        with _lock:
            if not _registered:
                multiprocessing.util.register_after_fork(_TOKEN, _after_fork)
                _registered = True
        watch_if_vllm_child()
    except Exception as exc:  # losing the watch must never stop the platform
        logger.warning("not watching the parent process: %s", exc)


def _after_fork(_token: object) -> None:
    global _lock, _watched
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _watched = None  # threads do not survive a fork: the parent's watch (if any) is not running here
    watch_if_vllm_child()


def watch_if_vllm_child() -> bool:
    """Start watching the parent if this process's multiprocessing name is a vLLM engine process's."""
    name = multiprocessing.current_process().name
    if not name.startswith(VLLM_CHILD_PREFIXES):
        return False
    parent = multiprocessing.parent_process()
    # in a spawned child the parent is known only after unpickling its Process object; the spawner is the parent
    watch_parent(parent.pid if parent is not None and parent.pid is not None else os.getppid(), name)
    return True


def watch_parent(parent_pid: int, what: str, *, grace_s: float | None = None) -> None:
    """Exit (SIGTERM, then SIGKILL after ``grace_s``) when process ``parent_pid`` exits. Once per process."""
    global _watched
    with _lock:
        if _watched is not None:
            return
        _watched = parent_pid
    grace = GRACE_S if grace_s is None else grace_s
    thread = threading.Thread(target=_watch, args=(parent_pid, what, grace), name="vllm-npu-parent-watch", daemon=True)
    thread.start()


def wait_for_exit(parent_pid: int) -> None:
    """Block until ``parent_pid`` (this process's parent) has exited."""
    try:
        fd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):  # no pidfd here: poll
        fd = None
    if fd is not None:
        try:
            # the parent may have died (and its pid been reused) before the open: we are reparented then
            if os.getppid() == parent_pid:
                select.select([fd], [], [])
        finally:
            os.close(fd)
        return
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)


def _watch(parent_pid: int, what: str, grace_s: float) -> None:
    wait_for_exit(parent_pid)
    logger.warning(
        "%s (pid %d): its parent process %d exited; shutting down to release the device", what, os.getpid(), parent_pid
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    logger.error("%s (pid %d) still running %.0f s after SIGTERM; killing it", what, os.getpid(), grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
