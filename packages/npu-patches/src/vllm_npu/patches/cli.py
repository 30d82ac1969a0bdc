# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu patches``: every patch with its scope, vLLM range, status here, upstream reference and removal plan.

    vllm-npu patches                 # table + details; status evaluated in this environment
    vllm-npu patches --markdown      # the docs table (docs/patches.md), independent of the environment
    vllm-npu patches --markdown --output docs/patches.md

Status values: ``applied`` (in this process), ``applies`` (in range, fingerprints match, enabled: a worker will
apply it), ``skipped: <why>`` (vLLM outside the range), ``disabled: <by what>``, ``FINGERPRINT MISMATCH: <...>``
(the engine would refuse to start). Exit code 1 on a fingerprint mismatch, 2 on a bad ``VLLM_NPU_PATCHES``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from vllm_npu.interface import ConfigError, distribution_version

from ._docs import render_markdown
from ._registry import PatchRegistry, PatchStatus, get_registry


def _status_lines(registry: PatchRegistry, check_fingerprints: bool) -> tuple[dict[str, str], bool]:
    disabled, sources = registry.disabled_ids()
    version = distribution_version("vllm")
    out: dict[str, str] = {}
    mismatch = False
    for patch in registry.patches():
        status, reason = registry.plan(
            patch.id, disabled=disabled, sources=sources, vllm_version=version, check_fingerprints=check_fingerprints
        )
        if status is PatchStatus.APPLIED:
            out[patch.id] = "applied"
        elif status is PatchStatus.DISABLED:
            out[patch.id] = f"disabled: {reason.removeprefix('disabled by ')}"
        elif status is PatchStatus.SKIPPED:
            out[patch.id] = f"skipped: {reason}"
        elif reason.startswith(("fingerprint mismatch", "error")):
            mismatch = True
            out[patch.id] = "FINGERPRINT MISMATCH: " + reason.split(": ", 1)[1]
        else:
            out[patch.id] = "applies" if check_fingerprints else "applies (fingerprints not checked)"
    return out, mismatch


def render_table(registry: PatchRegistry, check_fingerprints: bool = True) -> tuple[str, bool]:
    """The terminal report: a summary table, then each patch's details. Returns (text, any mismatch)."""
    status, mismatch = _status_lines(registry, check_fingerprints)
    rows = [("id", "scope", "vLLM", "status here")]
    rows += [(p.id, p.scope.value, p.vllm, status[p.id].split(": ", 1)[0]) for p in registry.patches()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"vLLM installed: {distribution_version('vllm') or 'not installed'}", ""]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[c]) if c < 3 else cell for c, cell in enumerate(row)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 11)
    for p in registry.patches():
        lines += [
            "",
            f"{p.id}  [{p.scope.value}, vLLM {p.vllm}, from {p.layer}]",
            f"  target:   {p.target}",
            f"  status:   {status[p.id]}",
            f"  why:      {p.reason}",
            f"  upstream: {p.upstream}",
            f"  removal:  {p.removal}",
        ]
    return "\n".join(lines) + "\n", mismatch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-npu patches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the docs table (docs/patches.md)")
    parser.add_argument("--output", metavar="PATH", help="write to PATH instead of stdout")
    parser.add_argument(
        "--no-fingerprints", action="store_true", help="do not import vLLM to verify fingerprints (faster)"
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    registry = get_registry()
    code = 0
    if args.markdown:
        text = render_markdown(registry)
    else:
        try:
            text, mismatch = render_table(registry, check_fingerprints=not args.no_fingerprints)
        except ConfigError as exc:
            print(f"vllm-npu patches: {exc}", file=sys.stderr)
            return 2
        code = 1 if mismatch else 0
    if args.output:
        # a temporary file beside the output, renamed over it: a failed write leaves the old file as it was
        tmp = f"{args.output}.tmp{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, args.output)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            print(f"vllm-npu patches: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
