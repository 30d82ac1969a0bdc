# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``multi-connector-stats``: MultiConnector stats rebuilt from their serialized form aggregate and reduce (vLLM
0.11.0 raised AttributeError on the second observation, killing the API server's output handler)."""

from __future__ import annotations


def _observe_twice(build):
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    # what the API server receives: the per-connector stats in their msgpack form (plain dicts)
    sent = {"MooncakeStoreConnector": {"data": {"failed": [], "loaded_blocks": 3, "loaded_bytes": 3000}}}
    acc: KVConnectorStats = build(data=sent)
    acc = acc.aggregate(build(data=sent))
    return acc.reduce()


def test_serialized_entries_are_rebuilt_and_aggregate() -> None:
    import inspect

    import pytest
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm_npu.kv import register
    from vllm_npu.patches.sets.multi_connector_stats import make_replacement

    register()  # the connector names, as the kv component's hook registers them in every process
    # vLLM's own method even when an in-process engine of this xdist worker has applied the patch
    shipped = classmethod(inspect.unwrap(MultiConnector.__dict__["build_kv_connector_stats"].__func__))
    with pytest.raises(AttributeError, match="'dict' object has no attribute 'aggregate'"):
        _observe_twice(shipped.__get__(None, MultiConnector))  # vLLM 0.11.0 as shipped
    patched = make_replacement(shipped).__get__(None, MultiConnector)
    reduced = _observe_twice(patched)
    assert reduced["MooncakeStoreConnector"]["pool hit blocks"] == 6
    # an entry no registered connector can rebuild is left out, not raised
    assert patched(data={"NoSuchConnector": {"x": 1}}).data == {}
