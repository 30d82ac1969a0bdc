# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""How many batch sizes may be captured: the NPU's stream limit.

Every captured ACL graph keeps a device stream for as long as it lives, and an Ascend device has a fixed number of
them (2048 per device with CANN 8). vllm-ascend found the practical ceiling at about 1800 captured graphs and keeps
the rest for the runtime's own streams (compute, copy, HCCL, the graph-update stream). We keep the same budget:

- graphs per captured batch size: PIECEWISE makes one graph per FX piece, i.e. ``num_layers + 1`` (the model is split
  at every attention op); FULL_DECODE_ONLY makes one graph.
- a collective inside a graph launches on its communication domain's own stream, captured with it: each parallel
  group larger than one (TP, DP, EP) multiplies the streams per graph by one more.

So ``max sizes = floor(GRAPH_STREAM_BUDGET / (graphs_per_size * (1 + comm_groups)))``. When the configured list is
longer, it is thinned evenly, always keeping the smallest size (batch 1, the most common decode) and the largest
(beyond which batches run eagerly). The emulated device applies the same limit, so the same sizes are captured as on
the NPU.
"""

from __future__ import annotations

import math

#: ACL streams per device (CANN 8) and the part of them captured graphs may hold.
DEVICE_STREAMS = 2048
GRAPH_STREAM_BUDGET = 1800


def max_capture_sizes(graphs_per_size: int, comm_groups: int) -> int:
    """How many batch sizes fit the stream budget (at least 1)."""
    per_size = max(1, graphs_per_size) * (1 + max(0, comm_groups))
    return max(1, math.floor(GRAPH_STREAM_BUDGET / per_size))


def thin_sizes(sizes: list[int], limit: int) -> list[int]:
    """At most ``limit`` of ``sizes`` (any order), evenly spread, smallest and largest kept; ascending."""
    ordered = sorted(set(sizes))
    if len(ordered) <= limit:
        return ordered
    if limit == 1:
        return [ordered[-1]]
    step = (len(ordered) - 1) / (limit - 1)
    return sorted({ordered[round(i * step)] for i in range(limit)})
