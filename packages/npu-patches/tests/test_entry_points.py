# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patches declared by other distributions through the ``vllm_npu.patches`` entry-point group."""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest
from vllm_npu.patches import PATCH_ENTRY_POINT_GROUP, Patch, PatchError
from vllm_npu.patches import _registry as registry_mod
from vllm_npu.patches.sets import BUILTIN_PATCHES

EXTRA = Patch(
    id="other-layer-fix",
    target="vllm.envs.VLLM_HOST_IP",
    replacement="m:f",
    scope="platform",
    vllm=">=0.11",
    fingerprint="b" * 64,
    upstream="none: test",
    reason="test",
    removal="test",
    layer="ops",
)


def fake_entry_points(load):
    def entry_points(group=None, **_):
        assert group == PATCH_ENTRY_POINT_GROUP
        return [SimpleNamespace(name="npu_ops", value="vllm_npu.ops._patches:PATCHES", load=load)]

    return entry_points


def test_declared_patches_follow_the_builtin_set(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points(lambda: [EXTRA]))
    patches = registry_mod._declared_patches()
    assert patches == [*BUILTIN_PATCHES, EXTRA]


def test_a_broken_declaration_names_itself(monkeypatch):
    def boom():
        raise ImportError("no module named vllm_npu.ops._patches")

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points(boom))
    with pytest.raises(
        PatchError, match=r"entry point 'npu_ops' \(vllm_npu.ops._patches:PATCHES\) in vllm_npu.patches"
    ):
        registry_mod._declared_patches()
