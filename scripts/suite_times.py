#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Where the suite's time goes: per-module wall time, per-folder totals and the slowest 20 tests of one pytest run.

Reads either of two records of a run, both written by the xdist controller under ``-n 2 --dist loadfile``:

- pytest's terminal output with ``--durations=0`` (the README command with ``--durations=0`` instead of 15, its
  output saved, e.g. ``... 2>&1 | tee run.log``): one line per setup / call / teardown, then the summary line with the
  session's wall time. With ``--durations=N`` only the N slowest phases are listed and the per-module times are
  partial (the report says so);
- a JUnit XML file (``--junitxml=run.xml``): one ``testcase`` per test with its setup + call + teardown time, and
  the session's wall time on the ``testsuite``.

Under ``--dist loadfile`` every module runs whole on one worker, one test after another, so a module's wall time is
the sum of its tests' phase times (its module-scoped engine start is the first test's setup). Not counted: import
and collection, and the idle tail of a worker; the session's wall time from the summary covers those. The budget
(README: 25 minutes on the 2-core machine) is checked against that wall time with ``--budget-min``.

Usage: python scripts/suite_times.py RUN.log|RUN.xml [--top 20] [--modules N] [--budget-min 25]
(exit 1 when the run's wall time exceeds the budget, 2 when the input holds no test times)
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("setup", "call", "teardown")
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")
# "==== 2241 passed, 3 warnings in 1178.20s (0:19:38) ====" (or without the rules under -q)
SUMMARY = re.compile(
    r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b.*?) in (\d+(?:\.\d+)?)s\b"
)
OUTCOME = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b")
SLOWEST = re.compile(r"^=+ slowest (?:(\d+) )?durations =+\s*$")


@dataclass
class Run:
    """Phase seconds per test node id, the session's wall time if the record has it, and a caveat if partial."""

    tests: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(PHASES, 0.0)))
    wall: float | None = None
    count: int | None = None  # tests the run reports (durations under 5 ms are not listed)
    partial: str | None = None

    def total(self, nodeid: str) -> float:
        return sum(self.tests[nodeid].values())


def module_of(nodeid: str) -> str:
    """``tests/e2e/test_demo.py::test_x[a]`` -> ``tests/e2e/test_demo.py``."""
    return nodeid.split("::", 1)[0]


def folder_of(module: str) -> str:
    """The folder a module's time is rolled up to: ``packages/<wheel>`` (its tests), else the module's directory."""
    parts = module.split("/")
    if parts[0] == "packages" and len(parts) > 2:
        return "/".join(parts[:2])
    return "/".join(parts[:-1]) or "."


def parse_durations(text: str) -> Run:
    """A pytest terminal output with ``--durations``."""
    run = Run()
    listed: int | None = None
    seen_header = False
    for line in text.splitlines():
        if m := SLOWEST.match(line):
            seen_header = True
            listed = int(m.group(1)) if m.group(1) else None
        elif m := DURATION.match(line):
            run.tests[m.group(3)][m.group(2)] += float(m.group(1))
        elif m := SUMMARY.match(line):
            run.wall = float(m.group(2))
            run.count = sum(int(n) for n, _ in OUTCOME.findall(m.group(1)))
    if seen_header and listed is not None:
        run.partial = f"the run listed only its {listed} slowest phases (--durations={listed}): per-module times are partial; use --durations=0 or --junitxml"
    return run


def _junit_module(case: ET.Element, root: Path | None) -> str:
    """The test file of a JUnit ``testcase``: its ``file`` attribute (xunit1), else its ``classname`` read as a path
    (``packages.npu-kv.tests.test_transfer.TestX`` -> ``packages/npu-kv/tests/test_transfer.py``), the longest prefix
    that is a file under ``root``, or without the trailing CamelCase class names."""
    if case.get("file"):
        return case.get("file", "")
    parts = case.get("classname", "").split(".")
    if root is not None:
        for cut in range(len(parts), 0, -1):
            candidate = "/".join(parts[:cut]) + ".py"
            if (root / candidate).is_file():
                return candidate
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py"


def parse_junit(text: str, root: Path | None = None) -> Run:
    """A ``--junitxml`` file (pytest's default ``junit_duration_report=total``: setup + call + teardown per test,
    booked here as ``call``)."""
    run = Run()
    tree = ET.fromstring(text)
    suites = [tree] if tree.tag == "testsuite" else tree.findall("testsuite")
    for suite in suites:
        run.count = (run.count or 0) + int(suite.get("tests", "0"))
        if suite.get("time"):
            run.wall = max(run.wall or 0.0, float(suite.get("time", "0")))
        for case in suite.iter("testcase"):
            module = _junit_module(case, root)
            run.tests[f"{module}::{case.get('name', '')}"]["call"] += float(case.get("time", "0"))
    return run


def parse(text: str, root: Path | None = None) -> Run:
    """Either record, told apart by its first character."""
    return parse_junit(text, root) if text.lstrip().startswith("<") else parse_durations(text)


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def report(run: Run, top: int = 20, modules: int | None = None, budget_min: float | None = None) -> tuple[str, bool]:
    """The printed report and whether the run is within the budget (True without a budget or a wall time)."""
    per_module: dict[str, float] = defaultdict(float)
    tests_in: dict[str, int] = defaultdict(int)
    for nodeid in run.tests:
        per_module[module_of(nodeid)] += run.total(nodeid)
        tests_in[module_of(nodeid)] += 1
    per_folder: dict[str, float] = defaultdict(float)
    for module, seconds in per_module.items():
        per_folder[folder_of(module)] += seconds
    summed = sum(per_module.values())
    reported = f" (the run reports {run.count})" if run.count is not None and run.count != len(run.tests) else ""
    lines = [
        f"{len(run.tests)} tests with times{reported} in {len(per_module)} modules; "
        f"test time summed over the workers: {minutes(summed)}"
    ]
    if run.wall is not None:
        lines.append(f"session wall time: {minutes(run.wall)}")
    ok = True
    if budget_min is not None and run.wall is not None:
        left = budget_min * 60 - run.wall
        ok = left >= 0
        lines.append(f"budget {budget_min:g} min: {minutes(abs(left))} {'left' if ok else 'OVER'}")
    if run.partial:
        lines.append(f"NOTE: {run.partial}")
    lines += ["", "per folder:", f"{'seconds':>9}  {'share':>5}  folder"]
    for folder, seconds in sorted(per_folder.items(), key=lambda kv: -kv[1]):
        lines.append(f"{seconds:9.1f}  {seconds / summed:5.1%}  {folder}")
    ranked = sorted(per_module.items(), key=lambda kv: -kv[1])
    shown = ranked if modules is None else ranked[:modules]
    lines += ["", f"per module ({len(shown)} of {len(ranked)}):", f"{'seconds':>9}  {'share':>5}  {'tests':>5}  module"]
    for module, seconds in shown:
        lines.append(f"{seconds:9.1f}  {seconds / summed:5.1%}  {tests_in[module]:5d}  {module}")
    lines += ["", f"top {top} tests:", f"{'seconds':>9}  {'setup':>7}  {'call':>7}  {'teardown':>8}  test"]
    for nodeid in sorted(run.tests, key=lambda n: -run.total(n))[:top]:
        p = run.tests[nodeid]
        lines.append(f"{run.total(nodeid):9.1f}  {p['setup']:7.1f}  {p['call']:7.1f}  {p['teardown']:8.1f}  {nodeid}")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path, help="pytest output with --durations=0, or a --junitxml file")
    parser.add_argument("--top", type=int, default=20, help="how many of the slowest tests to list (default 20)")
    parser.add_argument("--modules", type=int, default=None, help="list only the N slowest modules")
    parser.add_argument("--budget-min", type=float, default=None, help="exit 1 when the session took longer")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="the checkout")
    args = parser.parse_args(argv)
    run = parse(args.record.read_text(errors="replace"), args.root)
    if not run.tests:
        print(f"{args.record}: no test times (run pytest with --durations=0 or --junitxml)", file=sys.stderr)
        return 2
    text, ok = report(run, top=args.top, modules=args.modules, budget_min=args.budget_min)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
