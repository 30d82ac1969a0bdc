# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The testkit's engines run eagerly unless a test chooses a graph mode (issue 35: the emulated device's default
compiles and captures, which the suite's engines that do not test graphs would pay at every start)."""

from __future__ import annotations

import pytest
from npu_testkit.engine import pin_eager
from npu_testkit.serve import pin_eager_args


def test_llm_kwargs_without_a_graph_choice_are_pinned_eager():
    assert pin_eager({"dtype": "float32"}) == {"dtype": "float32", "enforce_eager": True}
    assert pin_eager({"additional_config": {"npu": {"kernels": "reference"}}})["enforce_eager"] is True


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enforce_eager": False},
        {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
        {"additional_config": {"npu": {"graph_mode": "torchair"}}},
        {"additional_config": {"npu": {"emulated_compile": "inductor"}}},
    ],
)
def test_llm_kwargs_that_choose_the_graph_mode_are_kept(kwargs):
    assert pin_eager(kwargs) == kwargs


def test_serve_args_are_pinned_eager_unless_they_choose():
    assert pin_eager_args(["m", "--dtype", "float32"]) == ["m", "--dtype", "float32", "--enforce-eager"]
    for chosen in (
        ["m", "--enforce-eager"],
        ["m", "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'],
        ["m", "-O3"],
        ["m", "--additional-config", '{"npu": {"graph_mode": "piecewise"}}'],
    ):
        assert pin_eager_args(chosen) == chosen
