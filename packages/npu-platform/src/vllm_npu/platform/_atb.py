# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""ATB (NNAL) at NPU worker start: register torch_npu's ATB ops and run one tiny ATB kernel.

torch_npu 2.8.0 loads ``lib/libop_plugin_atb.so`` (which links NNAL's ``libatb.so``) when
``torch_npu.op_plugin.atb._atb_ops`` is imported and keeps a load failure (a missing NNAL, or an NNAL that does not
match torch_npu / CANN: "undefined symbol") until ``_register_atb_extensions()`` runs, which raises it
(``op_plugin/atb/_atb_ops.py:58-87``). Until then ``torch_npu._npu_*`` / ``torch_npu.atb.*`` are lazy wrappers that
register on their first call (lines 92-104), i.e. inside the first attention forward. vllm-ascend v0.11.0 registers
in ``NPUWorker.__init__`` (``worker/worker_v1.py:27,88``) and warms ATB up with ``torch_npu._npu_matmul_add_fp32``
on tiny tensors (``worker_v1.py:337-341``). Doing both at worker start turns an NNAL problem into one clear error
before the model loads, and leaves real op objects (not Python wrappers) in place before anything is traced.
"""

from __future__ import annotations

import torch
from vllm_npu.interface import DeviceUnavailableError

#: What fixes an NNAL problem (its ATB library ships separately from CANN's toolkit).
NNAL_FIX = (
    "install the Ascend NNAL package whose version matches the installed CANN (and torch_npu 2.8.0), then run "
    "'source <NNAL install dir>/atb/set_env.sh' (default: /usr/local/Ascend/nnal/atb/set_env.sh) in the shell that "
    "starts vLLM"
)


def register_atb_extensions() -> None:
    """torch_npu's ATB registration, with torch_npu's load error turned into one that names the fix."""
    from torch_npu.op_plugin.atb._atb_ops import _register_atb_extensions

    try:
        _register_atb_extensions()
    except OSError as e:
        raise DeviceUnavailableError(f"torch_npu could not load its ATB ops (NNAL): {e}; {NNAL_FIX}") from e


def warm_up_atb(device: torch.device) -> None:
    """One tiny ATB kernel on ``device`` (fp16 [2, 4] x [2, 4]^T accumulated into an fp32 [4, 4]); a failure is
    reported with the NNAL fix."""
    import torch_npu

    x = torch.rand((2, 4), dtype=torch.float16).to(device)
    weight = torch.rand((2, 4), dtype=torch.float16).to(device)
    acc = torch.rand((4, 4), dtype=torch.float32).to(device)
    try:
        torch_npu._npu_matmul_add_fp32(x, weight, acc)
    except RuntimeError as e:
        raise DeviceUnavailableError(
            f"the ATB warm-up kernel (torch_npu._npu_matmul_add_fp32) failed: {e}; {NNAL_FIX}"
        ) from e


def prepare_atb(device: torch.device) -> None:
    """Registration, then the warm-up (the NPU worker's ``init_device``, after ``set_device``)."""
    register_atb_extensions()
    warm_up_atb(device)
