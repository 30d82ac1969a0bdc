# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The vLLM internals the kv layer overrides or reads, with the vLLM 0.11.0 signatures. Checked by
``tests/test_vllm_surface.py`` and ``vllm-npu doctor --vllm-surface``; see :mod:`vllm_npu.interface.vllm_surface`."""

from __future__ import annotations

from vllm_npu.interface import VllmName

SURFACE: tuple[VllmName, ...] = (
    VllmName(
        "vllm.v1.core.sched.scheduler:Scheduler",
        "_update_waiting_for_remote_kv",
        "method",
        "overrides",
        ("vllm_npu.kv.scheduler",),
        "PDScheduler recomputes a request whose KV pull failed there, before vLLM would take its unfilled blocks "
        "as computed",
        signature="(self, request)",
    ),
    VllmName(
        "vllm.v1.core.sched.scheduler:Scheduler",
        "finished_recving_kv_req_ids",
        "instance_attribute",
        "writes",
        ("vllm_npu.kv.scheduler",),
        "PDScheduler removes a failed request from the set of received ones, as vLLM does for a received one",
    ),
    VllmName(
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1",
        "_get_connector_metadata",
        "method",
        "calls",
        ("vllm_npu.kv.connector", "vllm_npu.kv.pool.connector"),
        "the worker halves read the step's tasks through it, as vLLM's own connectors do",
        signature="(self)",
    ),
    VllmName(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:OffloadingConnectorScheduler",
        "__init__",
        "method",
        "calls",
        ("vllm_npu.kv.pool.connector",),
        "the KV pool's scheduler half is vLLM's offloading scheduler over the pool's OffloadingManager (built with "
        "an object that has the spec's gpu_block_size, offloaded_block_size and get_manager)",
        signature="(self, spec)",
    ),
    VllmName(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:OffloadingConnectorScheduler",
        "_next_stored_block_idx",
        "instance_attribute",
        "writes",
        ("vllm_npu.kv.pool.connector",),
        "a request whose pool load failed is recomputed from token 0: its blocks are stored again as they complete",
    ),
    VllmName(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:OffloadingConnectorScheduler",
        "_reqs_being_stored",
        "instance_attribute",
        "writes",
        ("vllm_npu.kv.pool.connector",),
        "a kv_consumer pool instance stores nothing: its requests are not held for stores that never run",
    ),
    VllmName(
        "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:MultiConnector",
        "_connectors",
        "instance_attribute",
        "reads",
        ("vllm_npu.kv.scheduler",),
        "PDScheduler asks our connectors inside a MultiConnector (PD + KV pool) whether a request's load failed",
    ),
)
