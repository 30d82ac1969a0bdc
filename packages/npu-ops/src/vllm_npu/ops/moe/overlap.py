# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Shared-expert overlap (``npu.multistream_overlap_shared_expert``): the shared experts run on a side stream while
the routed experts (gate, dispatch, grouped matmuls, combine) run on the current one.

Order per forward, through the device backend's stream API (``Stream``, ``current_stream``, ``stream``)::

    side.wait_stream(main)          the side stream starts after the inputs made on main
    with stream(side): shared(x)    launched on the side stream
    routed(x)                       launched on main, concurrently
    main.wait_stream(side)          main waits before anything reads the shared output

Tensors crossing streams are marked with ``record_stream`` on real devices so the caching allocator does not hand
their memory to the other stream early. The emulated device's streams run in order and record these calls (its
stream log), which is what the tests check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def device_stream_api() -> dict[str, Any] | None:
    """The stream API of the platform's device backend (``{"Stream", "Event", "current_stream", "default_stream",
    "stream"}``), or None when vLLM's current platform has none (not ours)."""
    from vllm.platforms import current_platform

    backend = getattr(current_platform, "device_backend", None)
    api = getattr(backend, "stream_api", None)
    return api() if callable(api) else None


class SideStream:
    """One side stream per layer, created when the layer is built."""

    def __init__(self, api: dict[str, Any]) -> None:
        self.api = api
        self.stream = api["Stream"]()

    def overlap(
        self, shared: Callable[[torch.Tensor], torch.Tensor], routed: Callable[[], Any], x: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        """``(shared(x), routed())`` with ``shared`` on the side stream (the order of the module docstring)."""
        main = self.api["current_stream"]()
        self.stream.wait_stream(main)
        with self.api["stream"](self.stream):
            shared_out = shared(x)
        routed_out = routed()
        main.wait_stream(self.stream)
        if x.device.type != "cpu":
            x.record_stream(self.stream)  # read on the side stream, allocated on main
            shared_out.record_stream(main)  # allocated on the side stream, read on main
        return shared_out, routed_out


#: torchair's stream label of the shared experts in a compiled graph: vllm-ascend v0.11.0's
#: (``torchair/ops/torchair_fused_moe.py:134``, priority 0).
GRAPH_SIDE_STREAM = "moe_secondary"


def graph_overlap(
    shared: Callable[[torch.Tensor], torch.Tensor], routed: Callable[[], Any], x: torch.Tensor, *, npu: bool
) -> tuple[torch.Tensor, Any]:
    """``(shared(x), routed())`` inside a compiled torchair graph (while Dynamo traces): the shared experts' ops under
    torchair's stream scope, ``torchair.scope.npu_stream_switch(GRAPH_SIDE_STREAM, 0)``, which GE places on a
    second stream of the graph (the scope's ``air.scope_enter`` / ``scope_exit`` ops are executed by torchair's FX-to-GE
    converter while it builds the graph, ``fx2ge_converter.py``, and label the nodes between them); their only input
    is ``x``, so they run concurrently with the routed experts, and GE joins the streams where the outputs meet. No
    stream object or ``wait_stream`` is traced. ``npu=False`` (the emulated device: no torchair): both in order,
    the same values."""
    if not npu:
        return shared(x), routed()
    import torchair

    with torchair.scope.npu_stream_switch(GRAPH_SIDE_STREAM, 0):
        shared_out = shared(x)
    return shared_out, routed()
