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
