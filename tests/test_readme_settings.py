# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The README's settings tables are the schema's list of settings (vllm_npu.interface.settings), row for row."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_npu.interface import ADDITIONAL_CONFIG_SETTINGS, ENV_SETTINGS, Setting, markdown_rows

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("settings", [ENV_SETTINGS, ADDITIONAL_CONFIG_SETTINGS], ids=["env", "additional-config"])
def test_readme_table_matches_the_schema(settings: tuple[Setting, ...]) -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    expected = markdown_rows(settings)
    names = tuple(f"| `{s.name}` |" for s in settings)
    found = [line for line in lines if line.startswith(names)]
    assert found == expected, (
        "README.md's settings table differs from vllm_npu.interface.settings; replace its rows with:\n"
        + "\n".join(expected)
    )
    start = lines.index(expected[0])
    assert lines[start : start + len(expected)] == expected  # one contiguous block, in the schema's order
