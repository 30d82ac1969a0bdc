# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""eplb-platform-check: vLLM's ParallelConfig refuses --enable-eplb off CUDA without the patch; with it the config
is built (eplb_config kept, deprecated field folded) and vLLM's other EPLB checks still refuse bad input."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm.config.parallel import EPLBConfig, ParallelConfig
from vllm_npu.patches import PatchRegistry
from vllm_npu.patches.sets import EPLB_PLATFORM_CHECK

pytestmark = pytest.mark.usefixtures("vllm_unpatched")

EPLB = {"enable_eplb": True, "enable_expert_parallel": True, "tensor_parallel_size": 2}


@pytest.fixture
def patched() -> Iterator[None]:
    reg = PatchRegistry([EPLB_PLATFORM_CHECK])
    reg.apply(EPLB_PLATFORM_CHECK.scope, environ={})
    try:
        yield
    finally:
        reg.revert()


def test_vllm_refuses_eplb_off_cuda_without_the_patch():
    with pytest.raises(ValueError, match="only supported on CUDA"):
        ParallelConfig(**EPLB, eplb_config=EPLBConfig(num_redundant_experts=2))


def test_eplb_config_is_kept_with_the_patch(patched):
    cfg = ParallelConfig(**EPLB, eplb_config=EPLBConfig(num_redundant_experts=2, window_size=4, step_interval=3))
    assert cfg.enable_eplb is True
    assert (cfg.eplb_config.num_redundant_experts, cfg.eplb_config.window_size, cfg.eplb_config.step_interval) == (
        2,
        4,
        3,
    )


def test_deprecated_fields_are_folded_as_vllm_does(patched):
    cfg = ParallelConfig(**EPLB, num_redundant_experts=3, eplb_step_interval=7)
    assert (cfg.eplb_config.num_redundant_experts, cfg.eplb_config.step_interval) == (3, 7)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"enable_expert_parallel": False}, "enable_expert_parallel must be True"),
        ({"tensor_parallel_size": 1}, "tensor_parallel_size or data_parallel_size"),
        ({"eplb_config": EPLBConfig(num_redundant_experts=-1)}, "num_redundant_experts must be non-negative"),
    ],
)
def test_vllm_other_eplb_checks_still_refuse(patched, changes, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**{**EPLB, **changes})


def test_without_eplb_the_config_is_vllm_own(patched):
    assert ParallelConfig(tensor_parallel_size=2).enable_eplb is False
    with pytest.raises(ValueError, match="EPLB is not enabled"):
        ParallelConfig(tensor_parallel_size=2, eplb_config=EPLBConfig(num_redundant_experts=2))
