# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""docs/patches.md is generated from the registry; the ``vllm-npu patches`` CLI reports every patch."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_npu.patches import get_registry
from vllm_npu.patches._docs import render_markdown
from vllm_npu.patches.cli import main
from vllm_npu.patches.sets import BUILTIN_PATCHES, NOT_PATCHED

DOC = Path(__file__).resolve().parents[3] / "docs" / "patches.md"
REGEN = "vllm-npu patches --markdown --output docs/patches.md"


def test_generated_doc_matches_the_registry():
    assert DOC.is_file(), f"{DOC} is missing; generate it: {REGEN}"
    assert DOC.read_text(encoding="utf-8") == render_markdown(get_registry()), f"docs/patches.md is stale: {REGEN}"


def test_doc_lists_every_patch_and_every_rejected_candidate():
    text = render_markdown(get_registry())
    for p in BUILTIN_PATCHES:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{p.id}` |"))
        for cell in (p.target, p.scope.value, p.vllm):
            assert cell in row
    for what, _ in NOT_PATCHED:
        assert what.split(" ")[0] in text


def test_markdown_cli_output_is_the_doc(capsys, tmp_path):
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out == render_markdown(get_registry())
    out = tmp_path / "p.md"
    assert main(["--markdown", "--output", str(out)]) == 0
    assert out.read_text() == render_markdown(get_registry())


def test_table_shows_status_range_upstream_and_removal(capsys, monkeypatch, vllm_unpatched):
    monkeypatch.setenv("VLLM_NPU_PATCHES", "-attention-output-empty")
    assert main([]) == 0
    out = capsys.readouterr().out
    for p in BUILTIN_PATCHES:
        assert p.id in out and p.vllm in out and p.upstream in out and p.removal in out
    assert "status:   applies" in out  # repetition-penalty-torch: in range, fingerprints match
    assert "status:   disabled: VLLM_NPU_PATCHES=-attention-output-empty" in out


def test_unknown_id_in_env_exits_2_naming_known_ids(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_NPU_PATCHES", "-nope")
    assert main(["--no-fingerprints"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "repetition-penalty-torch" in err


def test_fingerprint_mismatch_exits_1(capsys, monkeypatch, vllm_unpatched):
    import vllm_npu.patches.cli as cli
    from vllm_npu.patches import Patch, PatchRegistry

    p = BUILTIN_PATCHES[0]
    changed = Patch(**{**p.__dict__, "fingerprint": "f" * 64})
    monkeypatch.setattr(cli, "get_registry", lambda: PatchRegistry([changed]))
    assert main([]) == 1
    assert "FINGERPRINT MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("scope", ["platform", "worker"])
def test_component_declares_the_hooks(scope):
    from vllm_npu.interface import Scope, resolve_hook
    from vllm_npu.patches._component import COMPONENT

    hook = COMPONENT.hook(Scope(scope))
    assert hook is not None and callable(resolve_hook(hook))
