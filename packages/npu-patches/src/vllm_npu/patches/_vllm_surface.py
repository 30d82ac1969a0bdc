# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM internals the patches' replacements read beyond their targets (the targets themselves are pinned by each
patch's fingerprint). Checked by ``tests/test_vllm_surface.py`` and ``vllm-npu doctor --vllm-surface``; see
:mod:`vllm_npu.interface.vllm_surface`."""

from __future__ import annotations

from vllm_npu.interface import VllmName

SURFACE: tuple[VllmName, ...] = (
    VllmName(
        "vllm.v1.metrics.loggers:PrometheusStatLogger",
        "_counter_cls",
        "attribute",
        "reads",
        ("vllm_npu.patches.sets.kv_connector_metrics",),
        "the KV pool / host offload counters are made with the logger's own counter class (Ray's wrapper when the "
        "logger runs under Ray), as vLLM's own counters are",
    ),
)
