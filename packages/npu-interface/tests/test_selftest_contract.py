# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The selftest contract layers hand ``vllm-npu selftest``: cases, calls, default outputs, seeded inputs."""

from __future__ import annotations

import torch
from npu_testkit.import_light import assert_import_light
from vllm_npu.interface import Kernel, KernelCall, KernelCase
from vllm_npu.interface.selftest import randn, randperm, returned


def test_default_outputs_name_the_returned_tensors() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    assert returned(a, (), {}) == {"out": a}
    assert returned((a, None, b), (), {}) == {"out0": a, "out2": b}
    assert returned(None, (), {}) == {}


def test_a_case_builds_the_same_inputs_on_every_call() -> None:
    kernel = Kernel("neg", npu=torch.neg, reference=torch.neg)
    case = KernelCase(
        kernel, "x [3]", "float32", lambda device: KernelCall((randn(7, 3, dtype=torch.float32, device=device),), {})
    )
    first, second = case.build("cpu"), case.build("cpu")
    assert torch.equal(first.args[0], second.args[0]) and first.outputs is returned
    assert case.tolerance is None and case.int_atol == 0
    assert torch.equal(randperm(3, 10, "cpu"), randperm(3, 10, "cpu")) and sorted(
        randperm(3, 10, "cpu").tolist()
    ) == list(range(10))


def test_the_contract_module_does_not_import_torch() -> None:
    assert_import_light("import vllm_npu.interface.selftest", forbid=("torch",))
