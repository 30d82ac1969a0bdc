# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The runtime section of ``vllm-npu selftest``: each row's verdict from what its probe, graph case or engine leg
reports (fake legs here; the real run on the emulated device is tests/e2e/test_selftest.py), and the graph-task rows
for real on the emulated device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from vllm_npu.interface import DeviceMode
from vllm_npu.platform.tools.cli import _selftest_graphs as graphs_rows
from vllm_npu.platform.tools.cli import _selftest_runtime as rt

TOKENS = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]


def _sleep_leg(*, phases: dict[str, list[list[int]]], after: int):
    def leg(extra):
        assert "--sleep-cycle" in extra and "FULL_DECODE_ONLY" in extra
        return {
            "token_ids": TOKENS,
            "phases": phases,
            "workers": [{"cudagraph_captured": 3}],
            "workers_after": [{"cudagraph_captured": after}],
        }

    return leg


def test_sleep_row_passes_when_tokens_hold_and_graphs_were_captured_again() -> None:
    row = rt._sleep_row(_sleep_leg(phases={"level1": TOKENS, "level2": TOKENS}, after=9))
    assert row["status"] == rt.PASS and "graphs captured [3] at start, [9]" in row["detail"]


@pytest.mark.parametrize(
    ("phases", "after"),
    [
        ({"level1": TOKENS, "level2": [[5, 6, 0], *TOKENS[1:]]}, 9),  # level 2 changed the tokens
        ({"level1": TOKENS, "level2": TOKENS}, 3),  # nothing was captured again: the old graphs would be replayed
    ],
)
def test_sleep_row_fails_on_other_tokens_or_no_recapture(phases, after) -> None:
    assert rt._sleep_row(_sleep_leg(phases=phases, after=after))["status"] == rt.FAIL


def _torchair_legs(shapes: list[list[int]], *, reuse: bool, tokens: list[list[list[int]]] | None = None):
    runs = iter(range(2))

    def leg(extra):
        i = next(runs)
        root = extra[extra.index("--torchair-cache-dir") + 1]
        name = "key-a" if reuse or i == 0 else "key-b"
        os.makedirs(os.path.join(root, name), exist_ok=True)
        ids = TOKENS if tokens is None else tokens[i]
        return {"token_ids": ids, "workers": [{"kv_cache_shape": shapes[i]}]}

    return leg


def test_torchair_row_passes_when_the_restart_compiles_into_a_new_directory() -> None:
    row = rt._torchair_row(DeviceMode.EMULATED, _torchair_legs([[2, 64], [2, 32]], reuse=False))
    assert row["status"] == rt.PASS and "compiled into a new one" in row["detail"]


def test_torchair_row_fails_when_the_restart_reuses_the_old_graphs() -> None:
    row = rt._torchair_row(DeviceMode.EMULATED, _torchair_legs([[2, 64], [2, 32]], reuse=True))
    assert row["status"] == rt.FAIL and "REUSED" in row["detail"]


def test_torchair_row_is_skipped_when_both_budgets_give_one_shape() -> None:
    row = rt._torchair_row(DeviceMode.NPU, _torchair_legs([[2, 64], [2, 64]], reuse=True))
    assert row["status"] == rt.SKIP


def test_a_leg_error_fails_its_row() -> None:
    row = rt._sleep_row(lambda extra: {"error": "the generate exited with status 1 (log above)"})
    assert row["status"] == rt.FAIL and "status 1" in row["detail"]


def test_graph_task_rows_capture_update_and_replay_on_the_emulated_device() -> None:
    rows = {r["check"]: r for r in graphs_rows.graph_rows(DeviceMode.EMULATED)}
    assert set(rows) == {"graph task (gqa)", "graph task (mla)"}
    for row in rows.values():
        assert row["status"] == "pass", row
        assert "the update changed the result" in row["detail"]


def test_a_graph_task_row_fails_when_the_update_is_lost(monkeypatch) -> None:
    from vllm_npu.attention import graph_task_cases

    (gqa, _) = graph_task_cases(False, torch.device("cpu"), torch.float32)
    # A runtime that skipped the task update would replay with the capture-time lengths.
    monkeypatch.setattr("vllm_npu.platform.graphs.emulated.twin.EmulatedGraph.refresh_tasks", lambda self: None)
    row = graphs_rows._run_case(gqa)
    assert row["status"] == "FAIL" and "max abs error vs eager" in row["detail"]


def test_probe_reports_an_untouched_front_end_and_the_fork_rule(tmp_path) -> None:
    """The probe process of the first two rows, on the emulated device with a tiny model built on the fly."""
    from npu_testkit.engine import emulated_env, tiny_config
    from npu_testkit.models import build_tiny_model

    model = build_tiny_model(tiny_config("qwen2"))
    out = tmp_path / "probe.json"
    env = {**os.environ, **emulated_env(tmp_path), "VLLM_WORKER_MULTIPROC_METHOD": "fork"}  # the probe drops it
    cmd = [
        sys.executable,
        "-m",
        "vllm_npu.platform.tools.cli._selftest_runtime",
        "probe",
        str(model),
        "float32",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    facts = json.loads(out.read_text())
    assert facts["front_end_initialized"] is False and facts["start_method"] == "spawn"
    assert facts["parent_initialized"] is True and "forked subprocess" in facts["child_error"]
