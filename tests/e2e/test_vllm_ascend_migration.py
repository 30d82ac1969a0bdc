# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A vllm-ascend user's --additional-config and VLLM_ASCEND_* variables on a real engine: harmless ones are named in
warnings and the engine serves; one that would change memory stops the start with the reason."""

from __future__ import annotations

import logging

import pytest
from npu_testkit.engine import emulated_env, engine, greedy

pytestmark = pytest.mark.engine


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_vllm_ascend_performance_settings_are_named_and_the_engine_serves(tiny_qwen2, tmp_path):
    # The platform logs under vLLM's logger tree, which does not propagate to pytest's caplog: listen on it directly
    # (after importing it: vLLM configures its loggers on import).
    from vllm_npu.platform.platform import logger

    collect = _Collect()
    logger.addHandler(collect)
    env = emulated_env(tmp_path, extra={"VLLM_ASCEND_ENABLE_NZ": "0", "VLLM_ASCEND_ENABLE_FOO": "1"})
    ascend = {"torchair_graph_config": {"enabled": True}, "ascend_scheduler_config": {"enabled": True}}
    try:
        with engine(tiny_qwen2, env, additional_config=ascend) as llm:
            [tokens] = greedy(llm, [[1, 2, 3]], max_tokens=4)
    finally:
        logger.removeHandler(collect)
    assert len(tokens) == 4
    named = sorted(m.split(" is ")[0] for m in collect.messages if "vllm-ascend" in m)
    assert named == [
        "--additional-config ascend_scheduler_config={'enabled': True}",
        "--additional-config torchair_graph_config={'enabled': True}",
        "environment VLLM_ASCEND_ENABLE_NZ='0'",
        "environment: VLLM_ASCEND_ENABLE_FOO",
    ]


def test_a_vllm_ascend_setting_that_changes_memory_stops_the_start(tiny_qwen2, tmp_path):
    # Raised in check_and_update_config, before any worker starts; vLLM's pydantic VllmConfig wraps it.
    match = r"lmhead_tensor_parallel_size=2 is a vllm-ascend setting .* cannot be ignored"
    bad = {"lmhead_tensor_parallel_size": 2}
    with pytest.raises(Exception, match=match), engine(tiny_qwen2, emulated_env(tmp_path), additional_config=bad):
        pass
