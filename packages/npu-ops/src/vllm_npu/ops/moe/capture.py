# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The MoE forward inside graphs: which path to take, and the host reads a graph must not contain.

vLLM's ``moe_forward`` is not a splitting op, so under PIECEWISE (and inside FULL_DECODE_ONLY's whole-model graph)
a MoE layer runs *inside* a captured ACL graph: its Python runs once, while the graph is captured, and only its
device work is replayed. A device-to-host read there (``.tolist()`` of split sizes, ``int(counts.sum())``)
synchronizes a stream that is being captured, which the NPU refuses; were it allowed, the value would be frozen into
every replay. So while a graph is captured (or traced by Dynamo for the torchair mode) the dispatchers take their
paths without host reads (:func:`in_graph_step`), and the exchanges that cannot do without one read through
:func:`host_ints`, which fails loudly there on both devices. On the emulated device the twin runs the layer's Python
during its capture the same way, so it fails where the NPU would, instead of silently re-running the op at replay.
"""

from __future__ import annotations

import torch
from vllm_npu.interface import NPUPluginError, active_recorder


class HostReadInCaptureError(NPUPluginError, RuntimeError):
    """A MoE exchange read device values on the host while a static graph was being captured."""


def capturing() -> bool:
    """Whether a static graph (ACL graph, the emulated twin) is being captured on this thread."""
    return active_recorder() is not None


def graph_runtime_step() -> bool:
    """Whether vLLM runs this step as a graph (its forward context's runtime mode is not NONE): on an NPU the layer's
    Python then runs only while the graph is captured; the emulated twin re-runs opaque ops at every replay, and
    taking the capture's path there too replays what the NPU graph holds."""
    from vllm import forward_context
    from vllm.config import CUDAGraphMode

    ctx = forward_context._forward_context  # get_forward_context() asserts outside a forward (_vllm_surface)
    mode = None if ctx is None else ctx.cudagraph_runtime_mode
    return mode is not None and mode != CUDAGraphMode.NONE


def in_graph_step() -> bool:
    """Whether this call is (or replays) part of a graph: traced by Dynamo, captured, or a graph step of vLLM's
    forward context. The dispatchers then take their paths without host reads."""
    return torch.compiler.is_compiling() or capturing() or graph_runtime_step()


def host_ints(values: torch.Tensor, what: str) -> list:
    """``values.tolist()``: a device-to-host read, refused while a static graph is being captured."""
    if capturing():
        raise HostReadInCaptureError(
            f"the MoE exchange read {what} on the host while a static graph was being captured: a captured graph "
            "cannot synchronize with the host, and the value would be frozen into every replay. Expert parallelism "
            "across data-parallel ranks exchanges rows with static shapes (all-gather / reduce-scatter, or MC2) "
            "when vLLM pads every DP rank's step to one size, i.e. without --enforce-eager; run with "
            "npu.graph_mode='eager' (or --enforce-eager) to use the variable-size all-to-all"
        )
    return values.tolist()
