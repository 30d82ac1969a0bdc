# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.models: the public API of the models layer.

Importing this package is cheap (exports load on first access): vLLM imports it in every process when it
discovers plugins.
"""

from vllm_npu.interface.lazy import lazy_exports

from ._version import __version__ as __version__

_EXPORTS: dict[str, str] = {
    "MODEL_OVERRIDES": "._hooks:MODEL_OVERRIDES",
    "register_models": "._hooks:register_models",
    "AscendDeepseekV32ForCausalLM": ".deepseek_v32:AscendDeepseekV32ForCausalLM",
    "AscendIndexer": ".deepseek_v32:AscendIndexer",
    "AscendIndexerKeyCache": ".deepseek_v32:AscendIndexerKeyCache",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted([*_EXPORTS, "__version__"])
