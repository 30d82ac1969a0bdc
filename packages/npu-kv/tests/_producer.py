# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Prefill-side workers in their own process for the transfer tests: ``python _producer.py PORT``.

Builds seeded caches and serves each configuration of :data:`CONFIGS` through one :class:`WorkerSide` per rank
(side channel on ``PORT + offset + rank``): GQA ``(2, nb, bs, heads, head)`` at TP=1, the same split over TP=2
ranks, and MLA ``(nb, bs, L + R)``. Prints ``ready``, then ``released <req_id> <config> rank <r>`` whenever a
worker frees a request; exits when stdin closes.
"""

from __future__ import annotations

import sys
import threading
import time

import torch
from vllm_npu.kv._worker_side import WorkerSide
from vllm_npu.kv.metadata import MooncakeConnectorMetadata
from vllm_npu.kv.settings import ConnectorSettings

NB, BS, HEADS, HEAD, LORA, ROPE = 12, 16, 4, 8, 24, 8


def full_caches(kind: str, layers: int = 2) -> dict[str, torch.Tensor]:
    """The whole-model caches every test derives its expectations from (all heads)."""
    g = torch.Generator().manual_seed(0)
    shape = (2, NB, BS, HEADS, HEAD) if kind == "gqa" else (NB, BS, LORA + ROPE)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g) for i in range(layers)}


def rank_caches(kind: str, rank: int, tp: int) -> dict[str, torch.Tensor]:
    full = full_caches(kind)
    if kind != "gqa":
        return {k: v.clone() for k, v in full.items()}
    h = HEADS // tp
    return {k: v[:, :, :, rank * h : (rank + 1) * h].contiguous() for k, v in full.items()}


#: name -> (cache kind, TP size, port offset)
CONFIGS = {"gqa-tp1": ("gqa", 1, 0), "gqa-tp2": ("gqa", 2, 1), "mla": ("mla", 1, 3)}
PORTS_USED = 4
REQS = [f"req-{i}" for i in range(8)]


def main() -> None:
    port = int(sys.argv[1])
    workers = []
    for config, (kind, tp, offset) in CONFIGS.items():
        settings = ConnectorSettings("127.0.0.1", port + offset, 30.0, 5.0, "kv_producer")
        for rank in range(tp):
            w = WorkerSide(settings, f"prefill-{config}", rank, tp, BS, LORA if kind == "mla" else None)
            w.register_kv_caches(rank_caches(kind, rank, tp))
            w.start_load_kv(MooncakeConnectorMetadata(reqs_to_send={r: time.monotonic() + 60 for r in REQS}))
            workers.append((config, w))
    print("ready", flush=True)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for config, w in workers:
                sending, _ = w.get_finished()
                for req in sorted(sending or ()):
                    print(f"released {req} {config} rank {w.tp_rank}", flush=True)
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    sys.stdin.read()
    stop.set()
    t.join()
    for _, w in workers:
        w.shutdown()


if __name__ == "__main__":
    main()
