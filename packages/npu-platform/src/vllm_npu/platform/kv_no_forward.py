# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The runner's step without a forward keeps the KV connectors' stats.

When nothing is scheduled (a request waits for its remote or pooled KV, or only stores are in flight) the runner takes
``kv_connector_no_forward``: it asks the connectors which transfers finished, then for their stats -- which hands the
stats over and resets them. vLLM 0.11.0 then returns the shared empty output unless a transfer finished, so stats
taken on such a step are lost: a pool load that completes between the two questions of an idle step, or a store that
finishes while no request runs, never reaches ``/metrics`` (``vllm:npu_kv_pool_*`` under-counts). vLLM 0.11.1 keeps
them (it tests ``KVConnectorOutput.is_empty()``, which counts the stats); :func:`kv_connector_no_forward` is that rule
on every release of the line, so the counters mean the same on 0.11.0.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.forward_context import set_forward_context
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin


def kv_connector_no_forward(scheduler_output: Any, vllm_config: Any) -> ModelRunnerOutput:
    """Run the connectors' per-step work (start loads, collect finished transfers and stats) without a forward.

    Returns vLLM's shared empty output only when nothing finished *and* no connector reported stats; otherwise a copy
    of it carrying the step's ``KVConnectorOutput``, which the scheduler turns into ``SchedulerStats``.
    """
    with (
        set_forward_context(None, vllm_config),
        KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output, wait_for_save=False) as kv_output,
    ):
        pass
    if kv_output.is_empty():
        return EMPTY_MODEL_RUNNER_OUTPUT
    output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
    output.kv_connector_output = kv_output
    return output
