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

``--ttft`` measures end to end instead: a tiny Qwen2 (float32, 2 layers, emulated device) served by two
``vllm serve`` instances (``kv_producer`` / ``kv_consumer``, MooncakeConnector over TCP) behind ``vllm-npu pd-proxy``;
per prompt length, the time from sending a streamed completion to its first token through the proxy vs sent to the
decode instance alone without remote prefill (the single-instance TTFT: the same engine computes the prompt itself).
Each request uses a fresh prompt (no prefix-cache hit). Median of ``--repeats``.
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


def first_token_s(url: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed greedy completion of ``prompt`` to ``url`` to its first token chunk."""
    import urllib.request

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    body.update(stream=True, return_token_ids=True)
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if (
                line.startswith("data: ")
                and line != "data: [DONE]"
                and json.loads(line[6:])["choices"][0].get("token_ids")
            ):
                elapsed = time.perf_counter() - t0
                resp.read()
                return elapsed
    raise RuntimeError(f"{url} streamed no token")


def ttft(lengths: list[int], repeats: int) -> list[dict]:
    """The ``--ttft`` rows: per prompt length, median TTFT through the proxy (PD) and on one instance, in ms."""
    import contextlib
    import os
    import statistics
    import tempfile
    from pathlib import Path

    from npu_testkit.engine import emulated_env, make_prompts, tiny_config
    from npu_testkit.models import build_tiny_model
    from npu_testkit.serve import free_port, vllm_server

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
    import pd_support

    max_len = max(lengths) + 64
    model = build_tiny_model(tiny_config("qwen2", max_position_embeddings=max_len))
    tmp = Path(tempfile.mkdtemp(prefix="pd-ttft-"))
    common = [str(model), "--dtype", "float32", "--max-model-len", str(max_len), "--block-size", "16"]
    common += ["--served-model-name", "tiny", "--max-num-batched-tokens", str(max_len)]
    roles = {
        "prefill": {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_port": free_port()},
        "decode": {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"},
    }
    rows = []
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, cfg in roles.items():
            env = {**os.environ, **emulated_env(tmp / name, multiprocessing=True)}
            args = [*common, "--kv-transfer-config", json.dumps(cfg)]
            urls[name] = stack.enter_context(vllm_server(args, env, tmp / f"{name}.log"))
        proxy = stack.enter_context(pd_support.proxy([urls["prefill"]], [urls["decode"]], tmp / "proxy.log"))
        seed = 100
        for target in ("pd", "single"):  # warm-up: first requests pay one-off costs (handshake, allocations)
            seed += 1
            first_token_s(proxy if target == "pd" else urls["decode"], make_prompts([64], seed=seed)[0])
        for tokens in lengths:
            got: dict[str, list[float]] = {"pd": [], "single": []}
            for _ in range(repeats):
                for target in got:
                    seed += 1
                    prompt = make_prompts([tokens], seed=seed)[0]
                    got[target].append(first_token_s(proxy if target == "pd" else urls["decode"], prompt))
            pd_ms = statistics.median(got["pd"]) * 1e3
            single_ms = statistics.median(got["single"]) * 1e3
            row = {
                "tokens": tokens,
                "pd_ttft_ms": round(pd_ms, 1),
                "single_ttft_ms": round(single_ms, 1),
                "pd_overhead_ms": round(pd_ms - single_ms, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--ttft", action="store_true", help="time to first token through vllm serve + pd-proxy")
    ap.add_argument("--producer", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.producer:
        producer(int(args.producer[0]), args.producer[1], int(args.producer[2]))
        return
    if args.ttft:
        rows = ttft(args.tokens, args.repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mode": "ttft", "results": rows}, f, indent=2)
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
