# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Start a KV pool: ``mooncake_master`` and one ``mooncake_client`` that lends the pool its memory.

The pool's memory must outlive the serving instances (instance A stores, A stops, a fresh instance B loads), so it
is lent by a process of its own, Mooncake's standalone client (``mooncake_client --global_segment_size``); serving
instances may lend more (``global_segment_size`` in their config; that memory leaves the pool with them). Both
binaries ship in the Mooncake wheels. No metadata server: the connector and the client use ``P2PHANDSHAKE``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from vllm_npu.interface import NPUPluginError


class PoolStartError(NPUPluginError, RuntimeError):
    """A pool process did not start (the message names the binary, the port and its log)."""


def mooncake_binary(name: str) -> str:
    """The path of a Mooncake binary (``mooncake_master``, ``mooncake_client``): the wheel's copy, else PATH."""
    try:
        import mooncake

        candidate = Path(next(iter(mooncake.__path__))) / name
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which(name)
    if found is None:
        raise PoolStartError(
            f"{name} not found: install the Mooncake wheel (npu-kv[ascend] on Ascend hosts, npu-kv[emulated] on CPU "
            "hosts), which ships it"
        )
    return found


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class PoolProcesses:
    """The running pool: ``master_address`` is what the connector's ``master_server_address`` must say."""

    host: str
    port: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[IO[bytes]] = field(default_factory=list)

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def master(self) -> subprocess.Popen[bytes]:
        return self.procs[0]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for log in self.logs:
            log.close()


def command_lines(
    host: str, port: int, metrics_port: int, client_port: int, segment_bytes: int, protocol: str = "tcp"
) -> list[list[str]]:
    """The two command lines: the master, then the client lending ``segment_bytes`` bytes."""
    return [
        [
            mooncake_binary("mooncake_master"),
            f"--rpc_port={port}",
            f"--rpc_address={host}",
            f"--metrics_port={metrics_port}",
            "--enable_http_metadata_server=false",
        ],
        [
            mooncake_binary("mooncake_client"),
            f"--master_server_address={host}:{port}",
            "--metadata_server=P2PHANDSHAKE",
            f"--host={host}",
            f"--port={client_port}",
            f"--global_segment_size={segment_bytes}",
            f"--protocol={protocol}",
        ],
    ]


def start_pool(
    host: str,
    port: int,
    metrics_port: int,
    client_port: int,
    segment_bytes: int,
    log_dir: str | os.PathLike[str],
    protocol: str = "tcp",
    timeout_s: float = 60.0,
) -> PoolProcesses:
    """Start the master and the memory-lending client; returns once both accept connections."""
    pool = PoolProcesses(host, port)
    names = ("mooncake_master", "mooncake_client")
    try:
        for name, cmd, ready_port in zip(
            names, command_lines(host, port, metrics_port, client_port, segment_bytes, protocol), (port, client_port)
        ):
            log = open(Path(log_dir) / f"{name}.log", "wb")  # noqa: SIM115 (closed by stop())
            pool.logs.append(log)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            pool.procs.append(proc)
            deadline = time.monotonic() + timeout_s
            while not _port_open(host, ready_port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise PoolStartError(
                        f"{name} did not come up on {host}:{ready_port} (exit code {proc.poll()}); see "
                        f"{Path(log_dir) / (name + '.log')}"
                    )
                time.sleep(0.2)
    except BaseException:
        pool.stop()
        raise
    return pool


@contextlib.contextmanager
def running_pool(*args: object, **kwargs: object) -> Iterator[PoolProcesses]:
    """:func:`start_pool` for the duration of the block."""
    pool = start_pool(*args, **kwargs)  # type: ignore[arg-type]
    try:
        yield pool
    finally:
        pool.stop()
