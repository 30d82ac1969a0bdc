# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""benchmarks/hybrid_memory.py's memory rows: the hybrid holds its attention KV plus a context-independent state, the
dense twin attention KV on every layer; the 80B row reproduces the published shape's sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import BENCHMARKS, load_script  # noqa: E402

bench = load_script("hybrid_memory", BENCHMARKS)


def test_memory_rows_without_an_engine(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--contexts", "1024", "8192", "--no-engine", "--json", str(out)]) == 0
    rows = {(r["model"], r["context"]): r for r in json.loads(out.read_text())["memory"]}
    big = rows[("qwen3-next-80b", 1024)]
    # 12 attention layers x 2 (K, V) x 2 KV heads x 256 x bf16 per token; 36 GDN layers x (conv 3 x 8192 + 32 x 128^2)
    assert big["hybrid_kv_bytes"] == 12 * 2 * 2 * 256 * 2 * 1024
    assert big["hybrid_state_bytes"] == 36 * (3 * 8192 + 32 * 128 * 128) * 2
    assert big["dense_total_bytes"] == 4 * big["hybrid_kv_bytes"]
    for model in ("tiny", "qwen3-next-80b"):
        short, long = rows[(model, 1024)], rows[(model, 8192)]
        assert short["hybrid_state_bytes"] == long["hybrid_state_bytes"] > 0  # the state does not grow
        assert long["ratio"] < short["ratio"] < 1
    assert "ratio" in capsys.readouterr().out
