# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""How many batch sizes may be captured: the NPU's stream limit.

Every captured ACL graph keeps device streams for as long as it lives, and an Ascend device has a fixed number of
them (2048 per device with CANN 8). vllm-ascend v0.11.0 (``update_aclgraph_sizes``, utils.py) lets captured graphs
hold about 1800 and keeps the rest for the runtime's own streams (compute, copy, HCCL, the graph-update stream); when
the graphs need more, capture fails with ACL error 0x7020023 ("insufficient available streams"). We use the same
budget, with the same arithmetic:

- ``G``, graphs per captured batch size: PIECEWISE makes one graph per FX piece, ``num_layers + 1`` (the model is
  split at every attention op), plus ``draft_layers + 1`` when an EAGLE/MTP draft model is captured with it;
  FULL_DECODE_ONLY makes one graph (vllm-ascend applies no limit there; with one graph per size the limit only
  matters for thousands of sizes, so we keep it).
- ``g``, communication groups: tensor parallel > 1 and data parallel > 1 each count one (a collective inside a graph
  runs on its communication domain's streams, captured with it).
- How HCCL expands a collective (``HCCL_OP_EXPANSION_MODE``):

  - default (FFTS+ on A2, AICPU on A3; AICPU may add up to rank_size - 1 streams per domain):
    ``floor((1800 - 40 g) / G / (1 + 2 g))``;
  - ``AIV``: ``floor(budget / G / f)`` with the parallel factor ``f = 1 + g + EP + overlap``, where EP is 1 with
    ``--enable-expert-parallel`` and overlap is 1 with ``npu.multistream_overlap_shared_expert``; for a MoE model
    ``f`` also counts data parallel > 1, for a dense model the budget drops by ``f * G`` (its all-reduces take more
    streams) instead.

When the configured list is longer, it is thinned evenly, always keeping the smallest size (batch 1, the most common
decode) and the largest (beyond which batches run eagerly). The emulated device applies the same limit, so that the
same sizes are captured as on the NPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_npu.interface import NPUPluginError

#: ACL streams per device (CANN 8) and the part of them captured graphs may hold.
DEVICE_STREAMS = 2048
GRAPH_STREAM_BUDGET = 1800
#: Streams set aside per communication group under HCCL's default (FFTS+ / AICPU) expansion.
STREAMS_PER_COMM_GROUP = 40
#: ``HCCL_OP_EXPANSION_MODE`` value that expands collectives on the AI vector cores.
AIV = "AIV"


@dataclass(frozen=True)
class StreamBudget:
    """The inputs of the capture-size limit (see the module docstring) and the limit itself (:attr:`max_sizes`)."""

    graphs_per_size: int  # G
    comm_groups: int  # g: TP > 1, DP > 1
    expansion_mode: str = ""  # HCCL_OP_EXPANSION_MODE as set ("" when unset)
    expert_parallel: bool = False
    shared_expert_overlap: bool = False
    moe: bool = False
    data_parallel: bool = False

    @property
    def aiv(self) -> bool:
        return self.expansion_mode == AIV

    @property
    def parallel_factor(self) -> int:
        """Streams per graph in AIV mode: the compute stream and one per communication domain / side stream."""
        factor = 1 + self.comm_groups + int(self.expert_parallel) + int(self.shared_expert_overlap)
        if self.moe:
            factor += int(self.data_parallel)
        return factor

    @property
    def max_sizes(self) -> int:
        """How many batch sizes fit (at least 1)."""
        graphs = max(1, self.graphs_per_size)
        if self.aiv:
            factor = self.parallel_factor
            budget = GRAPH_STREAM_BUDGET if self.moe else GRAPH_STREAM_BUDGET - factor * graphs
            limit = budget // (graphs * factor)
        else:
            g = max(0, self.comm_groups)
            limit = (GRAPH_STREAM_BUDGET - STREAMS_PER_COMM_GROUP * g) // (graphs * (1 + 2 * g))
        return max(1, limit)

    def describe(self) -> str:
        """The budget in words, for log lines and errors."""
        mode = "AIV" if self.aiv else f"{self.expansion_mode or 'unset'} (FFTS+/AICPU expansion)"
        terms = f"{self.graphs_per_size} graphs per size, {self.comm_groups} communication group(s)"
        if self.aiv:
            terms += f", parallel factor {self.parallel_factor}"
        return f"HCCL_OP_EXPANSION_MODE={mode}: {terms} -> at most {self.max_sizes} capture sizes"


def max_capture_sizes(graphs_per_size: int, comm_groups: int) -> int:
    """How many batch sizes fit under HCCL's default expansion (at least 1); :class:`StreamBudget` for the rest."""
    return StreamBudget(graphs_per_size, comm_groups).max_sizes


def thin_sizes(sizes: list[int], limit: int) -> list[int]:
    """At most ``limit`` of ``sizes`` (any order), evenly spread, smallest and largest kept; ascending."""
    ordered = sorted(set(sizes))
    if len(ordered) <= limit:
        return ordered
    if limit == 1:
        return [ordered[-1]]
    step = (len(ordered) - 1) / (limit - 1)
    return sorted({ordered[round(i * step)] for i in range(limit)})


class GraphStreamsExhaustedError(NPUPluginError, RuntimeError):
    """Capturing the configured graphs needed more device streams than the NPU has (ACL error 0x7020023); the message
    names the stream budget and the knobs that fix it (:func:`stream_exhaustion_message`)."""


#: ACL's "insufficient available streams" (vllm-ascend v0.11.0 model_runner_v1.py matches ``retCode=0x7020023``) and
#: the text torch_npu 2.8.0 gives the same ACL error (libtorch_npu.so's error table).
STREAM_EXHAUSTION_MARKERS = ("0x7020023", "Stream resources are insufficient")


def is_stream_exhaustion(error: BaseException) -> bool:
    """Whether a capture failed because the device ran out of streams (ACL error 0x7020023)."""
    text = str(error)
    return any(marker.lower() in text.lower() for marker in STREAM_EXHAUSTION_MARKERS)


def stream_exhaustion_message(mode: str, sizes: list[int], budget: StreamBudget) -> str:
    """What to tell the user when capturing ``sizes`` in graph mode ``mode`` ran out of streams."""
    fewer = (
        "capture fewer sizes: a shorter compilation_config.cudagraph_capture_sizes (or a smaller --max-num-seqs, "
        "which bounds vLLM's default list)"
    )
    aiv = (
        ""
        if budget.aiv
        else "; set HCCL_OP_EXPANSION_MODE=AIV (collectives expanded on the vector cores take fewer streams)"
    )
    full = "; use cudagraph_mode FULL_DECODE_ONLY (one graph per size)" if mode == "PIECEWISE" else ""
    return (
        f"ACL graph capture ran out of device streams (ACL error 0x7020023, insufficient available streams) while "
        f"capturing {len(sizes)} {mode} batch sizes {sorted(sizes)}; the stream budget was {budget.describe()}. "
        f"To fix it: {fewer}{aiv}{full}; or run eagerly with --enforce-eager or npu.graph_mode='eager'"
    )
