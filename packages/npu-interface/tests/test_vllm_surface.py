# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The drift check of vllm_npu.interface.vllm_surface against stand-in owners (no vLLM needed): each kind of drift
gives one line naming the version, the name, who relies on it and the table to edit."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
from vllm_npu.interface.vllm_surface import (
    REMOVED,
    VllmName,
    check_entry,
    check_surface,
    layer_surface,
    signature_text,
)

MODULE = "fake_vllm_runner"


class Runner:
    level = 3

    def __init__(self) -> None:
        self._buffers: dict[str, int] = {}

    def _sync_device(self) -> None: ...

    def execute_model(self, scheduler_output: object, intermediate_tensors: object = None) -> None: ...


@pytest.fixture(autouse=True)
def fake_module() -> Iterator[None]:
    module = types.ModuleType(MODULE)
    module.Runner = Runner  # type: ignore[attr-defined]
    module._state = None  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    yield
    del sys.modules[MODULE]


def entry(name: str, kind: str = "method", signature: str | None = "(self)", owner: str = f"{MODULE}:Runner"):
    return VllmName(
        owner,
        name,
        kind,  # type: ignore[arg-type]
        "overrides",
        ("vllm_npu.platform.model_runner",),
        "vLLM would sync with torch.cuda",
        signature=signature,
    )


def test_signature_text_drops_annotations_and_keeps_defaults() -> None:
    assert signature_text(Runner.execute_model) == "(self, scheduler_output, intermediate_tensors=None)"


def test_matching_entries_pass() -> None:
    assert (
        check_surface(
            [
                entry("_sync_device"),
                entry("level", "attribute", None),
                entry("_buffers", "instance_attribute", None),
                entry("_state", "module_global", None, owner=MODULE),
            ],
            vllm_version="0.11.0",
        )
        == []
    )


def test_a_missing_method_names_the_version_the_user_and_the_table() -> None:
    problem = check_entry(entry("_sync_gpu"), vllm_version="0.12.0")
    assert problem == (
        "vLLM 0.12.0 no longer has Runner._sync_gpu, which vllm_npu.platform.model_runner overrides: vLLM would "
        "sync with torch.cuda (adapt the code, then its entry in vllm_npu.platform._vllm_surface)"
    )


def test_a_changed_signature_shows_both() -> None:
    problem = check_entry(entry("_sync_device", signature="(self, stream)"), vllm_version="0.12.0")
    assert problem is not None
    assert "changed the signature of Runner._sync_device from (self, stream) to (self)" in problem


@pytest.mark.parametrize(
    ("name", "kind", "owner"),
    [("_gone", "instance_attribute", f"{MODULE}:Runner"), ("_gone", "module_global", MODULE)],
)
def test_missing_attributes_are_reported(name: str, kind: str, owner: str) -> None:
    problem = check_entry(entry(name, kind, None, owner=owner), vllm_version="0.12.0")
    assert problem is not None
    assert problem.startswith(f"vLLM 0.12.0 no longer has {owner.rpartition(':')[2] or owner}._gone")


def test_a_missing_owner_is_reported() -> None:
    problem = check_entry(entry("_sync_device", owner=f"{MODULE}:GPUModelRunner"), vllm_version="0.12.0")
    assert problem is not None
    assert f"no longer has {MODULE}:GPUModelRunner (AttributeError" in problem


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "field"}, "kind 'field' must be one of"),
        ({"use": "patches"}, "use 'patches' must be one of"),
        ({"signature": None}, "a method records its signature"),
        ({"owner": MODULE}, "owner must be 'module:Class'"),
        ({"used_by": ()}, "used_by and why are required"),
    ],
)
def test_malformed_entries_are_rejected(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "owner": f"{MODULE}:Runner",
        "name": "_sync_device",
        "kind": "method",
        "use": "overrides",
        "used_by": ("vllm_npu.platform.model_runner",),
        "why": "x",
        "signature": "(self)",
    }
    with pytest.raises(ValueError, match=message):
        VllmName(**{**fields, **kwargs})  # type: ignore[arg-type]


def test_a_layer_without_a_table_has_an_empty_surface() -> None:
    assert layer_surface("no_such_layer") == ()


def _changing(signature: str | None, changes: tuple[tuple[str, str], ...], kind: str = "method") -> VllmName:
    return VllmName(
        f"{MODULE}:Runner",
        "_sync_device",
        kind,  # type: ignore[arg-type]
        "overrides",
        ("vllm_npu.platform.model_runner",),
        "vLLM would sync with torch.cuda",
        signature=signature,
        changes=changes,
    )


def test_an_entry_records_each_release_of_the_line() -> None:
    changed = _changing("(self, old)", (("0.11.1", "(self)"),))
    assert changed.expected("0.11.0") == "(self, old)" and changed.expected("0.11.2") == "(self)"
    assert check_entry(changed, vllm_version="0.11.2") is None
    problem = check_entry(changed, vllm_version="0.11.0")
    assert problem is not None and "from (self, old) to (self)" in problem


def test_a_removed_entry_passes_where_it_is_gone_and_fails_where_it_is_back() -> None:
    gone = VllmName(
        f"{MODULE}:Runner",
        "_apply_bias",
        "method",
        "calls",
        ("vllm_npu.ops.lora.punica",),
        "LoRA bias",
        signature="(self)",
        changes=(("0.11.1", REMOVED),),
    )
    assert check_entry(gone, vllm_version="0.11.1") is None  # Runner has no _apply_bias
    assert "no longer has Runner._apply_bias" in (check_entry(gone, vllm_version="0.11.0") or "")
    back = _changing("(self)", (("0.11.1", REMOVED),))
    assert "which the entry records as removed" in (check_entry(back, vllm_version="0.11.2") or "")


@pytest.mark.parametrize(
    ("changes", "kind", "message"),
    [
        ((("0.11.2", "(self)"), ("0.11.1", "(self)")), "method", "release order"),
        ((("0.11.1", "(self)"),), "attribute", "records only its removal"),
    ],
)
def test_malformed_changes_are_rejected(changes: tuple[tuple[str, str], ...], kind: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _changing("(self)" if kind == "method" else None, changes, kind)
