# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""KV pull over Mooncake TCP on 127.0.0.1: the connector's time to KV-ready per prompt vs the raw Mooncake read.

For prompts of 128, 1024 and 4096 tokens (``--tokens``), a prefill worker (a child process) holds the prompt's
blocks; a decode worker pulls them through npu-kv's worker half (handshake once, batched read, ``done`` to the
prefill side) and, separately, with one bare ``batch_transfer_sync_read`` of the same segments. Reported per prompt:
milliseconds from task to KV-ready (what the decode side adds to the time to first token before its one-token
compute), the raw read's milliseconds, bandwidth of each, and the connector's overhead beyond the raw transfer.
``--geometry tiny`` is the test suite's Qwen2 (2 layers, 2 KV heads of 16, float32); ``7b`` a Qwen2-7B-shaped cache
(28 layers, 4 KV heads of 128, bfloat16). Block size 16. Best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import torch

GEOMETRIES = {"tiny": (2, 2, 16, torch.float32), "7b": (28, 4, 128, torch.bfloat16)}
BS = 16


def caches(geometry: str, blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    layers, heads, head, dtype = GEOMETRIES[geometry]
    make = torch.randn if fill else torch.zeros
    return {f"model.layers.{i}.self_attn.attn": make(2, blocks, BS, heads, head).to(dtype) for i in range(layers)}


def producer(port: int, geometry: str, blocks: int) -> None:
    from vllm_npu.kv._worker_side import WorkerSide
    from vllm_npu.kv.settings import ConnectorSettings

    w = WorkerSide(ConnectorSettings("127.0.0.1", port, 3600.0, 10.0, "kv_producer"), "bench-p", 0, 1, BS, None)
    w.register_kv_caches(caches(geometry, blocks, fill=True))
    print("ready", flush=True)
    sys.stdin.read()
    w.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--producer", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.producer:
        producer(int(args.producer[0]), args.producer[1], int(args.producer[2]))
        return

    from vllm_npu.kv._worker_side import WorkerSide
    from vllm_npu.kv.metadata import MooncakeConnectorMetadata, RecvTask
    from vllm_npu.kv.params import RemotePrefill
    from vllm_npu.kv.settings import ConnectorSettings

    max_blocks = -(-max(args.tokens) // BS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, __file__, "--producer", str(port), args.geometry, str(max_blocks)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    while (line := child.stdout.readline()) and line.strip() != "ready":
        pass
    w = WorkerSide(ConnectorSettings("127.0.0.1", 1, 3600.0, 10.0, "kv_consumer"), "bench-d", 0, 1, BS, None)
    w.register_kv_caches(caches(args.geometry, max_blocks, fill=False))
    results = []
    try:
        for n, tokens in enumerate(args.tokens):
            blocks = tuple(range(-(-tokens // BS)))
            best_conn = best_raw = float("inf")
            nbytes = 0
            for r in range(args.repeats):
                task = RecvTask(blocks, RemotePrefill(blocks, "bench-p", "127.0.0.1", port, 1, f"r{n}-{r}"))
                t0 = time.perf_counter()
                w.start_load_kv(MooncakeConnectorMetadata(reqs_to_recv={f"r{n}-{r}": task}))
                while not w.get_finished()[1]:
                    time.sleep(0.0002)
                best_conn = min(best_conn, time.perf_counter() - t0)
                stats = w.take_stats()
                assert stats is not None and not stats.data["failed"], "the pull failed"
                nbytes = stats.data["bytes"]
                # The same segments with one bare Mooncake read (handshake already cached by the connector).
                agent = next(iter(w._agents.values()))
                local, remote, lengths = [], [], []
                for name, layout in w.layers.items():
                    rl = next(layer for layer in agent.layers if layer.name == name)
                    for lp, rp in zip(layout.planes, rl.planes):
                        local.append(layout.base + lp.offset)
                        remote.append(rl.base + rp.offset)
                        lengths.append(len(blocks) * lp.block_bytes)
                assert w.engine is not None
                t0 = time.perf_counter()
                w.engine.read(agent.session_id, local, remote, lengths)
                best_raw = min(best_raw, time.perf_counter() - t0)
            row = {
                "tokens": tokens,
                "MB": round(nbytes / 1e6, 3),
                "connector_ms": round(best_conn * 1e3, 2),
                "raw_read_ms": round(best_raw * 1e3, 2),
                "connector_MB_s": round(nbytes / 1e6 / best_conn, 1),
                "raw_MB_s": round(nbytes / 1e6 / best_raw, 1),
                "overhead_ms": round((best_conn - best_raw) * 1e3, 2),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        w.shutdown()
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"geometry": args.geometry, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
