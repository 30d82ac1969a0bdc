# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The kv component's hook (see ``_component.py``); idempotent."""

from __future__ import annotations

from vllm_npu.interface import HookContext

#: Connector names -> "module:Class". ``MooncakeConnectorV1`` is the name vllm-ascend uses for its Mooncake
#: connector, so a vllm-ascend --kv-transfer-config keeps working.
CONNECTORS: dict[str, str] = {
    "MooncakeConnector": "vllm_npu.kv.connector:MooncakeConnector",
    "MooncakeConnectorV1": "vllm_npu.kv.connector:MooncakeConnector",
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
