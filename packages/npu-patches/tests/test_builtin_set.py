# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The built-in set against the installed vLLM (0.11.0, or another release of the line in a compatibility environment,
whose job runs this module): fingerprints match, each patch applies and reverts exactly; a patch whose range ends
before the installed release is skipped."""

from __future__ import annotations

import pytest
from vllm_npu.interface import distribution_version, in_range
from vllm_npu.patches import PatchRegistry, PatchStatus, fingerprint_path, get_registry
from vllm_npu.patches._model import resolve
from vllm_npu.patches.sets import BUILTIN_PATCHES

VLLM = distribution_version("vllm")
IDS = [p.id for p in BUILTIN_PATCHES]

pytestmark = pytest.mark.usefixtures("vllm_unpatched")


def test_installed_vllm_is_a_release_of_the_line_the_set_was_written_for():
    assert VLLM is not None and VLLM.split("+")[0] in ("0.11.0", "0.11.1", "0.11.2")


def _applies(patch) -> bool:
    return in_range(VLLM, patch.vllm, what=f"patch {patch.id} vllm range")


@pytest.mark.parametrize("patch", BUILTIN_PATCHES, ids=IDS)
def test_fingerprints_match_installed_vllm(patch):
    if not _applies(patch):  # ended upstream before this release: the registry skips it (checked below)
        [rec] = PatchRegistry([patch]).apply(patch.scope, environ={}, vllm_version=VLLM)
        assert rec.status is PatchStatus.SKIPPED
        return
    for path, expected in patch.fingerprints_for(VLLM):
        assert fingerprint_path(path) == expected, f"{patch.id}: {path} changed"


@pytest.mark.parametrize("patch", [p for p in BUILTIN_PATCHES if _applies(p)], ids=lambda p: p.id)
def test_applies_and_reverts_cleanly(patch):
    target = resolve(patch.target)
    before = target.raw()
    reg = PatchRegistry([patch])
    [rec] = reg.apply(patch.scope, environ={})
    assert rec.status is PatchStatus.APPLIED, rec.reason
    after = target.raw()
    assert after is not before and after.__vllm_npu_patch__ == patch.id
    reg.apply(patch.scope, environ={})  # twice: harmless
    assert target.raw() is after
    assert reg.revert() == [patch.id]
    assert target.raw() is before
    assert fingerprint_path(patch.target) == dict(patch.fingerprints_for(VLLM))[patch.target]


@pytest.mark.parametrize("patch", BUILTIN_PATCHES, ids=IDS)
def test_next_vllm_outside_the_range_is_skipped(patch):
    reg = PatchRegistry([patch])
    [rec] = reg.apply(patch.scope, environ={}, vllm_version="0.12.0")
    assert rec.status is PatchStatus.SKIPPED and "0.12.0" in rec.reason


def test_process_registry_holds_the_builtin_set_first():
    assert get_registry().ids()[: len(IDS)] == IDS


def test_every_builtin_patch_can_be_disabled_by_id():
    reg = PatchRegistry(BUILTIN_PATCHES)
    environ = {"VLLM_NPU_PATCHES": ",".join(f"-{i}" for i in IDS)}
    recs = reg.apply("worker", environ=environ)
    assert {r.status for r in recs} == {PatchStatus.DISABLED}
