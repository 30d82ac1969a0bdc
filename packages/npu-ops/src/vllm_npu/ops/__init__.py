# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.ops: the public API of the ops layer.

Importing this package is cheap (exports load on first access): vLLM imports it in every process when it
discovers plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS: dict[str, str] = {
    "selftest_cases": ".selftest:selftest_cases",
    "OOT_OPS": "._registry:OOT_OPS",
    "register_oot_ops": "._registry:register_oot_ops",
    # The rotary kernel pair npu-models' vision-tower overrides call (q and k with one cos/sin).
    "ROTARY_MUL_QK": ".rotary_embedding:ROTARY_MUL_QK",
}

if TYPE_CHECKING:
    from ._registry import OOT_OPS, register_oot_ops
    from .rotary_embedding import ROTARY_MUL_QK
    from .selftest import selftest_cases
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "OOT_OPS",
    "ROTARY_MUL_QK",
    "__version__",
    "register_oot_ops",
    "selftest_cases",
]
