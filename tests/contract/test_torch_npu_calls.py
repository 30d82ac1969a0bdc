# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Every torch_npu call in the plugin's source fits torch_npu 2.8.0's documented contract.

The NPU code paths cannot run here (no Ascend hardware, no CANN), so this is their compile-time check: each call
spelled ``torch_npu.<op>(...)`` or ``torch_npu.atb.<op>(...)`` in ``packages/*/src/**/*.py`` must name an op that the
wheel documents (op docs, ATB docs, or for ops documented nowhere else the meta registrations), pass only
documented keywords and a positional count the schema accepts, and give every required parameter.
"""

from __future__ import annotations

from pathlib import Path

from npu_testkit.npu_call_scan import NPUCall, find_npu_calls
from npu_testkit.torch_npu_docs import check_calls, load_docs

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(REPO.glob("packages/*/src/**/*.py"))


def _all_calls() -> list[NPUCall]:
    calls: list[NPUCall] = []
    for path in SOURCES:
        calls += find_npu_calls(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    return calls


def test_sources_found() -> None:
    assert len(SOURCES) > 20, f"expected the workspace's package sources under {REPO}/packages"


def test_every_torch_npu_call_is_documented() -> None:
    docs = load_docs()
    calls = _all_calls()
    problems = check_calls(calls, docs)
    assert not problems, "torch_npu calls outside the documented 2.8.0 contract:\n" + "\n".join(problems)


def test_no_call_of_an_op_whose_2_8_0_binding_is_unusable_here() -> None:
    """Documented signature or not, some 2.8.0 bindings fix a mode our layouts cannot use (npu_binding_rules)."""
    from npu_testkit.npu_binding_rules import UNUSABLE_IN_2_8_0

    bad = [
        f"{c.where}: torch_npu.{c.name}: {UNUSABLE_IN_2_8_0[c.name]}"
        for c in _all_calls()
        if c.name in UNUSABLE_IN_2_8_0
    ]
    assert not bad, "\n".join(bad)
