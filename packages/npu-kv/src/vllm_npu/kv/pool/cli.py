# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu kv-pool [--host H] [--port P] [--segment-size 16GB] [--config-out mooncake.json]``: start a KV pool
(``mooncake_master`` and the memory-lending ``mooncake_client``, :mod:`.launch`) and keep it running until
interrupted. ``--config-out`` writes the ``MOONCAKE_CONFIG_PATH`` file serving instances on this host can use."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

_UNITS = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}


def parse_size(text: str) -> int:
    """``"16GB"`` -> bytes (binary units: KB, MB, GB, TB; a bare number is bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*", text.upper())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 16GB, 512MB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-npu kv-pool",
        description="Start a KV pool for npu-kv's MooncakeStoreConnector: mooncake_master and a mooncake_client "
        "lending --segment-size bytes of host memory to the pool (it outlives the serving instances).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the master and the client listen on")
    p.add_argument("--port", type=int, default=50051, help="the master's RPC port (master_server_address)")
    p.add_argument("--metrics-port", type=int, default=9003, help="the master's HTTP metrics port")
    p.add_argument("--client-port", type=int, default=50052, help="the memory-lending client's port")
    p.add_argument("--segment-size", default="4GB", help="host memory the pool holds KV blocks in (e.g. 16GB)")
    p.add_argument("--protocol", default="tcp", help="transfer protocol (tcp; ascend on Ascend hosts, rdma)")
    p.add_argument("--config-out", default=None, help="write a MOONCAKE_CONFIG_PATH file for instances here")
    p.add_argument("--log-dir", default=None, help="where mooncake_master.log and mooncake_client.log go")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        segment = parse_size(args.segment_size)
    except ValueError as exc:
        print(f"vllm-npu kv-pool: --segment-size: {exc}", file=sys.stderr)
        return 2
    for flag in ("port", "metrics_port", "client_port"):
        if not 0 < getattr(args, flag) < 65536:
            print(f"vllm-npu kv-pool: --{flag.replace('_', '-')} is not a TCP port (1-65535)", file=sys.stderr)
            return 2
    from .launch import PoolStartError, start_pool

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm-npu-kv-pool-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        pool = start_pool(
            args.host, args.port, args.metrics_port, args.client_port, segment, log_dir, protocol=args.protocol
        )
    except PoolStartError as exc:
        print(f"vllm-npu kv-pool: {exc}", file=sys.stderr)
        return 1
    config = {
        "local_hostname": args.host,
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": pool.master_address,
        "global_segment_size": 0,
        "local_buffer_size": 1073741824,
        "protocol": args.protocol,
        "device_name": "",
    }
    if args.config_out:
        Path(args.config_out).write_text(json.dumps(config, indent=2) + "\n")
    print(
        f"KV pool up: master {pool.master_address}, {segment} bytes lent by mooncake_client; logs in {log_dir}\n"
        f"MOONCAKE_CONFIG_PATH file{' (' + args.config_out + ')' if args.config_out else ''}: {json.dumps(config)}",
        flush=True,
    )
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stop and all(p.poll() is None for p in pool.procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        names = ("mooncake_master", "mooncake_client")
        dead = [name for name, p in zip(names, pool.procs) if p.poll() is not None]
        pool.stop()
    if dead and not stop:
        print(f"vllm-npu kv-pool: {dead[0]} exited; see {log_dir}", file=sys.stderr)
        return 1
    return 0
