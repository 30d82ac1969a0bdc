# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Errors of the patches layer. Each names the patch id, its target and the fix."""

from __future__ import annotations

from vllm_npu.interface import NPUPluginError


class PatchError(NPUPluginError, RuntimeError):
    """A patch cannot be declared, applied or reverted."""


class PatchFingerprintError(PatchError):
    """The vLLM code a patch replaces is not the code the patch was written against.

    Raised only when the installed vLLM lies inside the patch's declared range: the range says "this patch is
    needed here" and the fingerprint says "but the code changed", so applying it blindly could silently undo a
    fix or break a contract. Never skipped quietly.
    """

    def __init__(self, patch_id: str, target: str, expected: str, found: str, vllm_version: str | None) -> None:
        self.patch_id = patch_id
        self.target = target
        self.expected = expected
        self.found = found
        super().__init__(
            f"patch {patch_id!r}: the source of {target} in the installed vLLM {vllm_version or '?'} is not the code "
            f"the patch was written against (fingerprint {found[:16]}…, expected {expected[:16]}…). The patch may "
            f"no longer be right for this vLLM. Disable it with VLLM_NPU_PATCHES=-{patch_id} (at your own risk), or "
            f"install a vLLM matching the plugin's pins, or update npu-patches."
        )
