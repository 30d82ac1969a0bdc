# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""docs/npu-calls.md lists every NPU call site of the sources, and nothing else.

Two tables, one scan each (AST only): the kernel table, every call of a ``torch_npu.*`` / ``torch_npu.atb.*`` /
``torch.ops.custom.*`` op (``npu_testkit.torch_npu_docs``, as the signature contract check scans them), and the
runtime table, every use of torch_npu's runtime: device, memory, streams, graphs, torchair, profiler, HCCL
(``npu_testkit.runtime_calls``). Rows are keyed by ``<module path>:<function>`` and op or call. A new call needs a row
(with its vllm-ascend v0.11.0 counterpart or the evidence for it), and a row whose call is gone must go too. The
runtime audit's rows (``A#1`` ... ``A#52`` of ``runtime-graphs-audit.md``) each have a status in the audit section.
"""

from __future__ import annotations

import re
from pathlib import Path

from npu_testkit.npu_call_scan import find_npu_call_sites
from npu_testkit.runtime_calls import find_runtime_call_sites

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "docs" / "npu-calls.md"
STATUSES = ("MATCHES", "DIFFERS", "NO REFERENCE")
_ROW = re.compile(r"^\| `([^`]+:[^`]+)` \| `([^`]+)` \| (.+?) \| (.+) \|$")


#: The audit's numbered rows (section A of runtime-graphs-audit.md) and the statuses the audit section gives them.
AUDIT_ROWS = range(1, 53)
AUDIT_STATUSES = ("fixed", "kept", "hardware")
_AUDIT = re.compile(r"^- \*\*A#(\d+)\*\* \((fixed|kept|hardware)\b")


def source_sites() -> set[tuple[str, str]]:
    sites = set()
    for path in sorted(REPO.glob("packages/*/src/vllm_npu/**/*.py")):
        rel = path.as_posix().split("/src/vllm_npu/", 1)[1]
        for site in find_npu_call_sites(path.read_text(encoding="utf-8"), str(path)):
            sites.add((f"{rel}:{site.function}", site.op))
    return sites


def runtime_sites() -> set[tuple[str, str]]:
    sites = set()
    for path in sorted(REPO.glob("packages/*/src/vllm_npu/**/*.py")):
        rel = path.as_posix().split("/src/vllm_npu/", 1)[1]
        for site in find_runtime_call_sites(path.read_text(encoding="utf-8"), str(path)):
            sites.add((f"{rel}:{site.function}", site.call))
    return sites


def table_rows(header: str = "| call site |") -> dict[tuple[str, str], tuple[str, str]]:
    rows: dict[tuple[str, str], tuple[str, str]] = {}
    in_table = False
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        if line.startswith(header):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        m = _ROW.match(line) if in_table else None
        if m:
            key = (m.group(1), m.group(2))
            assert key not in rows, f"duplicate row {key}"
            rows[key] = (m.group(3), m.group(4))
    return rows


def test_scan_finds_the_call_sites() -> None:
    sites = source_sites()
    assert ("attention/ops/kv_cache.py:reshape_and_cache_npu", "torch_npu._npu_reshape_and_cache") in sites
    assert ("attention/ops/sfa_kernels.py:lightning_indexer_npu", "torch.ops.custom.npu_lightning_indexer") in sites
    assert len(sites) > 30


def test_every_call_site_has_a_row_and_every_row_a_call() -> None:
    sites, rows = source_sites(), table_rows()
    missing = sorted(sites - rows.keys())
    stale = sorted(rows.keys() - sites)
    assert not missing, "NPU calls without a row in docs/npu-calls.md (add: site, op, vllm-ascend call, status):\n" + (
        "\n".join(f"| `{s}` | `{op}` |" for s, op in missing)
    )
    assert not stale, "rows of docs/npu-calls.md whose call is gone:\n" + "\n".join(f"{s} {op}" for s, op in stale)


def test_rows_name_a_counterpart_and_a_status() -> None:
    for (site, op), (va, status) in table_rows().items():
        assert va.strip(), (site, op)
        assert status.startswith(STATUSES), f"{site} {op}: status must start with one of {STATUSES}: {status!r}"
        if va.startswith("none"):  # no counterpart: not a match, and the evidence for our usage is given
            assert not status.startswith("MATCHES"), (site, op, status)
        if status.startswith("NO REFERENCE"):
            assert va.startswith("none") and ":" in status, f"{site} {op}: NO REFERENCE rows name their evidence"


def test_runtime_scan_finds_the_call_sites() -> None:
    sites = runtime_sites()
    assert ("platform/_device.py:NPUDevice.set_device", "torch.npu.set_device") in sites
    assert ("platform/graphs/_npu.py:NPUGraph.capture", "torch.npu.graph") in sites
    assert len(sites) > 30


def test_every_runtime_call_has_a_row_and_every_row_a_call() -> None:
    sites, rows = runtime_sites(), table_rows("| runtime call site |")
    missing = sorted(sites - rows.keys())
    stale = sorted(rows.keys() - sites)
    assert not missing, "runtime calls without a row in docs/npu-calls.md (add: site, call, vllm-ascend, status):\n" + (
        "\n".join(f"| `{s}` | `{call}` |" for s, call in missing)
    )
    assert not stale, "runtime rows of docs/npu-calls.md whose call is gone:\n" + "\n".join(
        f"{s} {c}" for s, c in stale
    )
    for (site, call), (va, status) in rows.items():
        assert va.strip(), (site, call)
        assert status.startswith(STATUSES), f"{site} {call}: status must start with one of {STATUSES}: {status!r}"


def test_every_audit_row_has_a_status() -> None:
    statuses: dict[int, str] = {}
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        m = _AUDIT.match(line)
        if m:
            assert int(m.group(1)) not in statuses, f"A#{m.group(1)} twice"
            statuses[int(m.group(1))] = m.group(2)
    missing = [n for n in AUDIT_ROWS if n not in statuses]
    assert not missing, f"audit rows without a status in docs/npu-calls.md: {', '.join(f'A#{n}' for n in missing)}"
