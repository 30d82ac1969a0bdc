# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU side of the structured-output mask (``GRAMMAR_BITMASK.npu``) calls no torch_npu op, only aten ops: each
one it dispatches on the device must have an NPU kernel in torch_npu 2.8.0, i.e. be listed under ``supported`` in
the wheel's ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (read from the wheel, never imported), or
be a view that aten implements for every backend (a ``CompositeExplicitAutograd`` kernel over ``as_strided``).

The ops are recorded with a dispatch mode while the mask runs on ``meta`` tensors standing for the device (the
host-to-device copies of the bitmask and the row indices included), for every row and for some rows.
"""

from __future__ import annotations

import zipfile
from typing import Any

import pytest
import torch
from npu_testkit.torch_npu_docs import DocsUnavailableError, wheel_path
from torch.utils._python_dispatch import TorchDispatchMode

YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"


def _npu_supported() -> set[str]:
    """``name.overload`` (or ``name`` for the default overload) of every op torch_npu registers for the NPU."""
    import yaml

    try:
        wheel = wheel_path()
    except DocsUnavailableError as exc:  # pragma: no cover - offline without a cached wheel
        pytest.skip(str(exc))
    with zipfile.ZipFile(wheel) as zf:
        doc = yaml.safe_load(zf.read(YAML))
    names = set()
    for entry in doc["supported"]:
        func = entry if isinstance(entry, str) else entry["func"]
        names.add(func.split("(", 1)[0].strip())
    return names


class _DeviceOps(TorchDispatchMode):
    """Records ``name.overload`` of every aten op dispatched with a ``meta`` tensor (the stand-in device)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if any(t.device.type == "meta" for t in tensors) or kwargs.get("device") == torch.device("meta"):
            overload = func._overloadname
            self.ops.append(func._schema.name.split("::")[1] + ("" if overload == "default" else f".{overload}"))
        return func(*args, **kwargs)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3]], ids=["every_row", "some_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_device_op_of_the_npu_mask_has_an_npu_kernel(rows, dtype):
    from vllm_npu.platform.sample.grammar import _bit_values, grammar_mask_npu

    supported = _npu_supported()
    _bit_values.cache_clear()  # its one-time copy to the device is recorded too
    logits = torch.empty(4, 151936, dtype=dtype, device="meta")
    with _DeviceOps() as mode:
        grammar_mask_npu(logits, rows, torch.zeros(len(rows), 4748, dtype=torch.int32))
    assert {"bitwise_and.Tensor", "eq.Scalar", "masked_fill_.Scalar", "_to_copy"} <= set(mode.ops), mode.ops
    missing = [
        op
        for op in mode.ops
        if op not in supported
        and not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CompositeExplicitAutograd")
    ]
    assert missing == [], f"ops without an NPU kernel in torch_npu 2.8.0: {missing}"
