# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.quant: the public API of the quant layer (the ``ascend`` method for msModelSlim checkpoints).

Importing this package is cheap (exports load on first access): vLLM imports it in every process when it
discovers plugins.
"""

from vllm_npu.interface.lazy import lazy_exports

from ._version import __version__ as __version__

_EXPORTS: dict[str, str] = {
    "selftest_cases": ".selftest:selftest_cases",
    "AscendQuantConfig": ".config:AscendQuantConfig",
    "register": ".config:register",
    "QUANT_METHOD": ".detect:QUANT_METHOD",
    "claim_checkpoint": ".detect:claim_checkpoint",
    "QuantDescription": ".description:QuantDescription",
    "QuantDescriptionError": ".description:QuantDescriptionError",
    "QuantLoadError": ".params:QuantLoadError",
    "quantize_checkpoint": ".quantizer:quantize_checkpoint",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted([*_EXPORTS, "__version__"])
