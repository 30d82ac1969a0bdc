# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The kv component's hook (see ``_component.py``); idempotent."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_npu.interface import HookContext

#: Connector names -> "module:Class". ``MooncakeConnectorV1`` and ``MooncakeConnectorStoreV1`` are the names
#: vllm-ascend uses for its Mooncake PD connector and its Mooncake store pool, so a vllm-ascend --kv-transfer-config
#: keeps working; ``MooncakeConnector`` and ``MooncakeStoreConnector`` are the documented ones.
CONNECTORS: dict[str, str] = {
    "MooncakeConnector": "vllm_npu.kv.connector:MooncakeConnector",
    "MooncakeConnectorV1": "vllm_npu.kv.connector:MooncakeConnector",
    "MooncakeStoreConnector": "vllm_npu.kv.pool.connector:MooncakeStoreConnector",
    "MooncakeConnectorStoreV1": "vllm_npu.kv.pool.connector:MooncakeStoreConnector",
}


def register() -> list[str]:
    """Register :data:`CONNECTORS` with vLLM's ``KVConnectorFactory`` (lazily: nothing is imported until an instance
    uses one). Returns the names registered now; a name vLLM already knows is left alone."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    done = []
    for name, target in CONNECTORS.items():
        module, _, cls = target.partition(":")
        try:
            KVConnectorFactory.register_connector(name, module, cls)
        except ValueError:  # "already registered": this process ran the hook, or vLLM ships the name itself
            continue
        done.append(name)
    return done


def on_load(ctx: HookContext) -> None:
    """Every process, when vLLM loads general plugins: register the connectors."""
    register()


#: vLLM's own V1 scheduler (the default) and the one that recomputes a request whose KV pull failed.
VLLM_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
PD_SCHEDULER = "vllm_npu.kv.scheduler.PDScheduler"


def select_scheduler(kv_connector: str | None, scheduler_cls: object, sub_connectors: Sequence[str] = ()) -> object:
    """The scheduler class an instance should use: :data:`PD_SCHEDULER` when it runs one of :data:`CONNECTORS`
    (alone, or among ``sub_connectors`` of vLLM's ``MultiConnector``) with vLLM's default scheduler, otherwise
    ``scheduler_cls`` unchanged (an explicit choice is the user's; the async scheduler keeps vLLM 0.11's behaviour,
    where a failed pull is not recomputed)."""
    ours = kv_connector in CONNECTORS or (
        kv_connector == "MultiConnector" and any(c in CONNECTORS for c in sub_connectors)
    )
    if ours and scheduler_cls in (VLLM_SCHEDULER, "vllm.core.scheduler.Scheduler"):
        return PD_SCHEDULER
    return scheduler_cls
