# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Host-device synchronisations per decode step inside the model forward (target: 0).

On an NPU every call that needs a device value on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``,
data-dependent shapes such as ``nonzero`` / boolean-mask indexing / ``repeat_interleave`` without ``output_size``)
stalls the host until the device queue drains, which kills the launch pipelining. The emulated device runs the same
Python code paths, so they can be counted here: during the model forward of pure decode steps (8 requests decoding),
the script counts calls of those APIs made from Python anywhere (model, CustomOps, attention impl) by wrapping them,
and prints the calling line of each. Syncs inside C++ kernels are not visible (there are none in the reference
kernels: they are torch ops).

Caveats: on the emulated device every tensor lives on the host, so a call on a tensor that is host-resident on an
NPU too (e.g. ``seq_lens_cpu.tolist()``) is counted although it would not sync there; and the forward runs the
*reference* kernels, so a sync inside a reference twin is counted even if its NPU twin has none. The printed call
sites tell which case applies. Also counted, separately: the same APIs in the rest of ``execute_model`` (input
preparation and sampling sync by design, e.g. the sampled token ids go to the host once per step).

Run: ``.venv/bin/python benchmarks/host_syncs.py [--strict]`` (``--strict``: exit 1 if the forward syncs).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

import torch  # noqa: E402

_TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")
_TORCH_FUNCS = ("nonzero", "masked_select", "unique", "unique_consecutive", "argwhere")


class SyncCounter:
    def __init__(self) -> None:
        self.active: str | None = None  # which scope is being counted: "forward" or "execute_model"
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._depth = 0

    def record(self, api: str) -> None:
        if self.active is None or self._depth:
            return
        self._depth += 1  # calls made while recording (traceback formatting) are not syncs of the model
        try:
            frame = next(
                (
                    f
                    for f in reversed(traceback.extract_stack()[:-2])
                    if "/torch/" not in f.filename and f.filename != __file__
                ),
                None,
            )
            where = f"{frame.filename}:{frame.lineno}" if frame else "?"
            self.counts[self.active][f"{api} @ {where}"] += 1
        finally:
            self._depth -= 1

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved: list[tuple[Any, str, Any]] = []
        counter = self

        def wrap(owner: Any, name: str, label: str, check: Any = None) -> None:
            original = getattr(owner, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if check is None or check(*args, **kwargs):
                    counter.record(label)
                return original(*args, **kwargs)

            saved.append((owner, name, original))
            setattr(owner, name, wrapper)

        for name in _TENSOR_METHODS:
            wrap(torch.Tensor, name, f"Tensor.{name}")
        for name in _TORCH_FUNCS:
            wrap(torch, name, f"torch.{name}")
        # repeat_interleave with a tensor of repeats and no output_size has a data-dependent output shape.
        wrap(
            torch,
            "repeat_interleave",
            "torch.repeat_interleave(no output_size)",
            lambda x, repeats=None, *a, **k: isinstance(repeats, torch.Tensor) and k.get("output_size") is None,
        )
        wrap(
            torch.Tensor,
            "repeat_interleave",
            "Tensor.repeat_interleave(no output_size)",
            lambda self, repeats=None, *a, **k: isinstance(repeats, torch.Tensor) and k.get("output_size") is None,
        )

        def bool_index(self: Any, index: Any) -> bool:
            items = index if isinstance(index, tuple) else (index,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)

        wrap(torch.Tensor, "__getitem__", "boolean-mask indexing", bool_index)
        try:
            yield
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--strict", action="store_true", help="exit 1 if the decode forward syncs")
    args = parser.parse_args()

    from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
    from npu_testkit.models import build_tiny_model

    model = build_tiny_model(tiny_config("qwen2"))
    prompts = make_prompts([24] * args.prompts, seed=0)
    counter = SyncCounter()
    steps = collections.Counter()
    with engine(model, emulated_env(tempfile.mkdtemp(prefix="bench-syncs-"))) as llm:
        runner = llm.collective_rpc(lambda self: self.model_runner)[0]  # in-process engine core
        forward, execute = runner.model.forward, runner.execute_model

        def counted_forward(input_ids: Any = None, *a: Any, **k: Any) -> Any:
            decode = input_ids is not None and input_ids.shape[0] <= args.prompts
            previous = counter.active
            counter.active = "decode forward" if decode else None
            steps["decode forward" if decode else "prefill forward"] += 1
            try:
                return forward(input_ids, *a, **k)
            finally:
                counter.active = previous

        def counted_execute(*a: Any, **k: Any) -> Any:
            counter.active = "execute_model (excluding the forward)"
            steps["execute_model"] += 1
            try:
                return execute(*a, **k)
            finally:
                counter.active = None

        runner.model.forward = counted_forward
        runner.execute_model = counted_execute
        with counter.installed():
            greedy(llm, prompts, args.tokens)

    forward_syncs = sum(counter.counts["decode forward"].values())
    n_decode = max(steps["decode forward"], 1)
    print(f"decode steps: {steps['decode forward']} (batch {args.prompts}), prefill steps: {steps['prefill forward']}")
    print(f"host syncs per decode step inside the model forward: {forward_syncs / n_decode:.2f} (target 0)")
    for where, n in counter.counts["decode forward"].most_common():
        print(f"  {n / n_decode:6.2f}/step  {where}")
    other = counter.counts["execute_model (excluding the forward)"]
    print(
        f"host syncs per step in the rest of execute_model (by design: inputs, sampled ids): "
        f"{sum(other.values()) / max(steps['execute_model'], 1):.2f}"
    )
    for where, n in other.most_common(8):
        print(f"  {n / max(steps['execute_model'], 1):6.2f}/step  {where}")
    if args.strict and forward_syncs:
        sys.exit(1)


if __name__ == "__main__":
    main()
