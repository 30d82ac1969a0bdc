# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.quant: the public API of the quant layer (the ``ascend`` method for msModelSlim checkpoints).

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
    "AscendQuantConfig": ".config:AscendQuantConfig",
    "register": ".config:register",
    "QUANT_METHOD": ".detect:QUANT_METHOD",
    "claim_checkpoint": ".detect:claim_checkpoint",
    "QuantDescription": ".description:QuantDescription",
    "QuantDescriptionError": ".description:QuantDescriptionError",
    "QuantLoadError": ".params:QuantLoadError",
    "quantize_checkpoint": ".tools.quantizer:quantize_checkpoint",
}

if TYPE_CHECKING:
    from .config import AscendQuantConfig, register
    from .description import QuantDescription, QuantDescriptionError
    from .detect import QUANT_METHOD, claim_checkpoint
    from .params import QuantLoadError
    from .selftest import selftest_cases
    from .tools.quantizer import quantize_checkpoint
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "QUANT_METHOD",
    "AscendQuantConfig",
    "QuantDescription",
    "QuantDescriptionError",
    "QuantLoadError",
    "__version__",
    "claim_checkpoint",
    "quantize_checkpoint",
    "register",
    "selftest_cases",
]
