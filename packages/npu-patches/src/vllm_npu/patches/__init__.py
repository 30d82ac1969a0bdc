# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.patches: the public API of the patches layer, THE way any vllm-npu layer monkey-patches vLLM.

    from vllm_npu.patches import Patch, register_patch
    register_patch(Patch(id="my-fix", target="vllm.x.y.f", replacement="vllm_npu.mylayer._fix:make",
                         scope="worker", vllm=">=0.11.0,<0.12", fingerprint=fingerprint_path("vllm.x.y.f"), ...))

``apply_patches(scope)`` / ``revert_patches()`` drive the process-wide registry (the component hooks call
``apply_patches`` at plugin load and worker init). See docs/patches.md for the current set.

Importing this package is cheap (exports load on first access): vLLM imports it in every process when it
discovers plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS: dict[str, str] = {
    "Patch": "._model:Patch",
    "fingerprint_of": "._model:fingerprint_of",
    "fingerprint_path": "._model:fingerprint_path",
    "PatchError": "._errors:PatchError",
    "PatchFingerprintError": "._errors:PatchFingerprintError",
    "PatchRegistry": "._registry:PatchRegistry",
    "PatchRecord": "._registry:PatchRecord",
    "PatchStatus": "._registry:PatchStatus",
    "PATCH_ENTRY_POINT_GROUP": "._registry:PATCH_ENTRY_POINT_GROUP",
    "get_registry": "._registry:get_registry",
    "register_patch": "._registry:register_patch",
    "apply_patches": "._registry:apply_patches",
    "revert_patches": "._registry:revert_patches",
    "patch_status": "._registry:patch_status",
    "patch_report": "._registry:patch_report",
}

if TYPE_CHECKING:
    from ._errors import PatchError, PatchFingerprintError
    from ._model import Patch, fingerprint_of, fingerprint_path
    from ._registry import (
        PATCH_ENTRY_POINT_GROUP,
        PatchRecord,
        PatchRegistry,
        PatchStatus,
        apply_patches,
        get_registry,
        patch_report,
        patch_status,
        register_patch,
        revert_patches,
    )
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "PATCH_ENTRY_POINT_GROUP",
    "Patch",
    "PatchError",
    "PatchFingerprintError",
    "PatchRecord",
    "PatchRegistry",
    "PatchStatus",
    "__version__",
    "apply_patches",
    "fingerprint_of",
    "fingerprint_path",
    "get_registry",
    "patch_report",
    "patch_status",
    "register_patch",
    "revert_patches",
]
