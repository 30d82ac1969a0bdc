# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""docs/npu-calls.md lists every NPU call site of the sources, and nothing else.

The sources are scanned like the signature contract check (``npu_testkit.torch_npu_docs``, AST only): every call of a
``torch_npu.*`` / ``torch_npu.atb.*`` / ``torch.ops.custom.*`` op, keyed by ``<module path>:<function>`` and op. A
new call needs a row (with its vllm-ascend v0.11.0 counterpart or the evidence for it), and a row whose call is gone
must go too.
"""

from __future__ import annotations

import re
from pathlib import Path

from npu_testkit.torch_npu_docs import find_npu_call_sites

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "docs" / "npu-calls.md"
STATUSES = ("MATCHES", "DIFFERS", "NO REFERENCE")
_ROW = re.compile(r"^\| `([^`]+:[^`]+)` \| `([^`]+)` \| (.+?) \| (.+) \|$")


def source_sites() -> set[tuple[str, str]]:
    sites = set()
    for path in sorted(REPO.glob("packages/*/src/vllm_npu/**/*.py")):
        rel = path.as_posix().split("/src/vllm_npu/", 1)[1]
        for site in find_npu_call_sites(path.read_text(encoding="utf-8"), str(path)):
            sites.add((f"{rel}:{site.function}", site.op))
    return sites


def table_rows() -> dict[tuple[str, str], tuple[str, str]]:
    rows: dict[tuple[str, str], tuple[str, str]] = {}
    in_table = False
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        if line.startswith("| call site |"):
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
