# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The one gate in front of the Triton kernels the gated delta-net layers run on an NPU.

vllm-ascend v0.11.0 runs Qwen3-Next's decode kernels (fused recurrent gated delta rule, gated RMS norm, the GDN gating,
the single-token causal conv1d) as Triton kernels compiled by Triton-Ascend (PyPI ``triton-ascend``). On an NPU our
GDN kernel pairs call vLLM's Triton functions for those; this module checks, on first use, that a Triton with an
active driver is there, and otherwise raises an error that names the install line. The emulated device and CI never
get here (they run the reference twins), and nothing imports Triton at module import.
"""

from __future__ import annotations

from vllm_npu.interface import MissingComponentError

#: What a user installs to run the GDN layers on an NPU (the ``gdn`` extra of npu-models pulls triton-ascend).
INSTALL_LINE = 'pip install "npu-models[gdn]" (triton-ascend; uninstall the CUDA triton vLLM pulls in)'


def require_triton_ascend(kernel: str) -> None:
    """Raise :class:`MissingComponentError` naming :data:`INSTALL_LINE` unless vLLM found a working Triton.

    vLLM decides ``HAS_TRITON`` once per process (``vllm.triton_utils.importing``: Triton installed and one active
    driver); without it vLLM's FLA modules hold placeholders and a kernel launch would fail far from the cause."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise MissingComponentError(
            "models",
            f"the gated delta-net kernel {kernel!r} runs on the NPU as a Triton kernel and no Triton with an active "
            "driver is installed",
            fix=f"install Triton-Ascend: {INSTALL_LINE}",
        )
