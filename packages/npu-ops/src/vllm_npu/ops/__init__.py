# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.ops: the public API of the ops layer.

Importing this package is cheap (exports load on first access): vLLM imports it in every process when it
discovers plugins.
"""

from vllm_npu.interface.lazy import lazy_exports

from ._version import __version__ as __version__

_EXPORTS: dict[str, str] = {
    "selftest_cases": ".selftest:selftest_cases",
    "OOT_OPS": "._registry:OOT_OPS",
    "register_oot_ops": "._registry:register_oot_ops",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted([*_EXPORTS, "__version__"])
