# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The component hooks drive the process-wide registry: worker patches at worker init, honouring both settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm_npu.interface import ConfigError, DeviceMode, HookContext, Scope
from vllm_npu.patches import PatchStatus, get_registry, patch_report, patch_status, revert_patches
from vllm_npu.patches._hooks import on_load, on_worker_init

pytestmark = pytest.mark.usefixtures("vllm_unpatched")


def ctx(scope: Scope, disabled: list[str] | None = None) -> HookContext:
    cfg = SimpleNamespace(additional_config={"npu": {"disabled_patches": disabled or []}})
    return HookContext(mode=DeviceMode.EMULATED, scope=scope, vllm_config=cfg if scope is Scope.WORKER else None)


def test_worker_hook_applies_worker_patches_and_reads_additional_config(monkeypatch):
    import vllm._custom_ops as ops

    monkeypatch.delenv("VLLM_NPU_PATCHES", raising=False)
    on_load(ctx(Scope.PLATFORM))  # the built-in set's platform patches; no worker patch yet
    applied = {pid for pid, (s, _) in patch_status().items() if s is PatchStatus.APPLIED}
    platform_ids = [
        "eplb-platform-check",
        "shutdown-ends-requests",
        "request-fault-isolation",
        "unsupported-api-status",
        "host-offload-stats",
        "multi-connector-stats",
        "kv-connector-metrics",
        "hybrid-prefill-no-drafts",
    ]
    revert_patches(ids=platform_ids)
    assert applied == set(platform_ids)
    on_worker_init(ctx(Scope.WORKER, disabled=["attention-output-empty"]))
    try:
        status = patch_status()
        assert status["repetition-penalty-torch"][0] is PatchStatus.APPLIED
        assert ops.apply_repetition_penalties.__vllm_npu_patch__ == "repetition-penalty-torch"
        assert status["attention-output-empty"] == (
            PatchStatus.DISABLED,
            "disabled by --additional-config npu.disabled_patches",
        )
        report = patch_report(object())  # what llm.collective_rpc(patch_report) returns per worker
        assert report["repetition-penalty-torch"]["installed"] is True
        assert report["attention-output-empty"] == {
            "status": "disabled",
            "reason": "disabled by --additional-config npu.disabled_patches",
            "target": "vllm.attention.layer.Attention.forward",
            "scope": "worker",
            "installed": False,
        }
    finally:
        # Every worker patch the hook applied, not only the one checked: a patch left applied in the process-wide
        # registry leaks into later test modules of this pytest process.
        revert_patches(ids=[pid for pid, (s, _) in patch_status().items() if s is PatchStatus.APPLIED])
    assert not hasattr(ops.apply_repetition_penalties, "__vllm_npu_patch__")


def test_worker_hook_rejects_unknown_ids(monkeypatch):
    monkeypatch.setenv("VLLM_NPU_PATCHES", "-no-such-patch")
    with pytest.raises(
        ConfigError,
        match="known ids: attention-output-empty, bert-token-types-no-shift, eagle-discarded-next-token, "
        "eplb-platform-check, host-offload-npu, host-offload-stats, hybrid-prefill-no-drafts, kv-connector-metrics, "
        "lora-npu-layers, multi-connector-stats, multimodal-merge-index-put, repetition-penalty-torch, request-fault-isolation, "
        "roberta-token-types-no-shift, shutdown-ends-requests, unsupported-api-status",
    ):
        on_worker_init(ctx(Scope.WORKER))
    assert all(r.status is not PatchStatus.APPLIED for r in get_registry().records())
