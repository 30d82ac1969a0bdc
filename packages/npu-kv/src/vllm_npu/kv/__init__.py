# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.kv: prefill-decode disaggregation (the Mooncake KV connector and the PD proxy) and the KV pool.

Importing this package is cheap (exports load on first access): vLLM imports it in every process when it
discovers plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS: dict[str, str] = {
    "CONNECTORS": "._hooks:CONNECTORS",
    "MooncakeConnector": ".connector:MooncakeConnector",
    "MooncakeStoreConnector": ".pool.connector:MooncakeStoreConnector",
    "MooncakeUnavailableError": ".engine:MooncakeUnavailableError",
    "PDScheduler": ".scheduler:PDScheduler",
    "TransferEngineHandle": ".engine:TransferEngineHandle",
    "register": "._hooks:register",
    "select_scheduler": "._hooks:select_scheduler",
}

if TYPE_CHECKING:
    from ._hooks import CONNECTORS, register, select_scheduler
    from .connector import MooncakeConnector
    from .engine import MooncakeUnavailableError, TransferEngineHandle
    from .pool.connector import MooncakeStoreConnector
    from .scheduler import PDScheduler
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "CONNECTORS",
    "MooncakeConnector",
    "MooncakeStoreConnector",
    "MooncakeUnavailableError",
    "PDScheduler",
    "TransferEngineHandle",
    "__version__",
    "register",
    "select_scheduler",
]
