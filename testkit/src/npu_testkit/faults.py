# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Fault injection for the bad-input suite: a per-request logits processor that raises for the requests that ask.

Load it with ``logits_processors=["npu_testkit.faults:FailingRequestLogitsProcessor"]`` (``LLM``) or
``--logits-processors npu_testkit.faults:FailingRequestLogitsProcessor`` (``vllm serve``). A request whose
``SamplingParams.extra_args`` (OpenAI: ``vllm_xargs``) holds ``FAIL_KEY`` gets a per-request processor that raises
:class:`InjectedFault` on its first row; every other request gets none (its logits are untouched).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

#: The ``extra_args`` key that makes a request's logits processing fail; its value is put in the message.
FAIL_KEY = "npu_testkit_fail"


class InjectedFault(RuntimeError):
    """The error the injected per-request logits processor raises."""


class FailingRequestLogitsProcessor(AdapterLogitsProcessor):
    """vLLM's adapter for per-request logits processors, failing exactly the requests that carry :data:`FAIL_KEY`."""

    def is_argmax_invariant(self) -> bool:
        return False  # so that vLLM applies it for greedy requests too

    def new_req_logits_processor(self, params: Any) -> Any:
        tag = (params.extra_args or {}).get(FAIL_KEY)
        if tag is None:
            return None

        def fail(output_ids: list[int], logits: Any) -> Any:
            raise InjectedFault(f"injected fault for {tag}")

        return fail
