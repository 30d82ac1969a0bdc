# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Kernel calls per decoder layer per decode step, counted on the emulated device with a real vLLM engine.

A tiny model (``npu_testkit`` Qwen2 or Llama, 2 layers) runs one request through prefill and N decode steps. Inside
the worker, each decoder layer's forward is wrapped with a dispatch counter (``TorchDispatchMode``):

- every ops-layer kernel (the ``_norm``/``_add_norm``/``_kernel``/``_rotary_mul``/``_mrope`` a layer selected at
  build) counts as ONE call, whatever its reference does inside (on the NPU it is one torch_npu launch; add+RMSNorm
  is one ``npu_add_rms_norm``);
- the attention op (``vllm.unified_attention_with_output`` or the backend impl) counts as one call;
- every other aten op that computes counts as one call (matmuls, copies, index ops); view/metadata ops
  (``view``, ``t``, ``slice``, ``split``, ``empty``...) are not kernels and are not counted.

Prefill steps are excluded (only steps where the layer sees one token per request). Layer 0 also gathers the
rotary cos/sin for the whole forward; later layers reuse it, so their count is the steady-state figure.

Run: ``.venv/bin/python benchmarks/ops_kernel_calls.py [--arch qwen2|llama] [--steps 8] [--json out.json]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

KERNEL_ATTRS = ("_norm", "_add_norm", "_kernel", "_rotary_mul", "_mrope")
NOT_KERNELS = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "detach",
    "alias",
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unsqueeze",
    "squeeze",
    "expand",
    "as_strided",
    "unbind",
    "chunk",
    "narrow",
    "_to_copy_noop",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "is_same_size",
}


def install(model: Any) -> int:
    """Wrap every decoder layer's kernels and forward with counters; returns the number of layers."""
    layers = model.model.layers
    current: dict[str, Any] = {"sink": None}  # the counter of the layer running now (None outside counted steps)
    _wrap_kernels(model, current)
    model._ops_bench = {"steps": [collections.Counter() for _ in layers], "n": [0] * len(layers)}
    mode_cls = _counting_mode_cls()
    for idx, layer in enumerate(layers):
        _count_decode_steps(model, idx, layer, current, mode_cls)
    return len(layers)


def _counting_mode_cls() -> type:
    """A ``TorchDispatchMode`` adding one to its sink per computing aten op (views and metadata ops excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self, sink: collections.Counter) -> None:
            super().__init__()
            self.sink = sink

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            name = func.overloadpacket.__name__
            if not (func.is_view or name in NOT_KERNELS):
                label = "attention op" if "attention" in name else f"aten.{name}"
                self.sink[label] += 1
            return func(*args, **(kwargs or {}))

    return Counting


def _wrap_kernels(model: Any, current: dict[str, Any]) -> None:
    """Each ops-layer kernel attribute counts as one call into the running layer's sink, nothing inside it."""
    import torch

    def wrap_kernel(label: str, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            sink = current["sink"]
            if sink is None:
                return fn(*a, **k)
            sink[label] += 1
            with torch._C._DisableTorchDispatch():  # the kernel is one call: nothing inside it is counted
                return fn(*a, **k)

        counted._ops_bench_wrapped = True  # type: ignore[attr-defined]
        return counted

    # Modules shared between layers (vLLM's get_rope returns one rotary module per model) are wrapped once.
    for mod in model.modules():
        for attr in KERNEL_ATTRS:
            fn = mod.__dict__.get(attr)
            if callable(fn) and not getattr(fn, "_ops_bench_wrapped", False):
                setattr(mod, attr, wrap_kernel(f"kernel {getattr(fn, '__name__', attr)}", fn))
        if "_full_rotary" in mod.__dict__:  # RoPE binds its kernel into its fast path at build: rebind the wrapper
            mod._bind_rotary_kernel(mod._rotary_mul)


def _count_decode_steps(model: Any, idx: int, layer: Any, current: dict[str, Any], mode_cls: type) -> None:
    """Hooks on layer ``idx``: a counting mode around each decode-step forward, added to ``model._ops_bench``."""
    state: dict[str, Any] = {"mode": None}

    def pre(mod: Any, args: tuple, kwargs: dict) -> None:
        positions = args[0] if args else kwargs["positions"]
        if positions.shape[-1] != 1:  # prefill or mixed step: not counted
            return
        current["sink"] = collections.Counter()
        state["mode"] = mode_cls(current["sink"])
        state["mode"].__enter__()

    def post(mod: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if state["mode"] is None:
            return
        state["mode"].__exit__(None, None, None)
        model._ops_bench["steps"][idx].update(current["sink"])
        model._ops_bench["n"][idx] += 1
        state["mode"], current["sink"] = None, None

    layer.register_forward_pre_hook(pre, with_kwargs=True)
    layer.register_forward_hook(post, with_kwargs=True)


def collect(model: Any) -> dict:
    b = model._ops_bench
    return {"steps": b["n"], "counts": [dict(c) for c in b["steps"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    p.add_argument("--steps", type=int, default=8, help="decode steps (generated tokens - 1)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
    from npu_testkit.models import build_tiny_model

    model_dir = build_tiny_model(tiny_config(args.arch))
    with tempfile.TemporaryDirectory() as tmp, engine(model_dir, emulated_env(tmp)) as llm:
        (n_layers,) = llm.apply_model(install)
        greedy(llm, make_prompts([8], seed=0), args.steps + 1)
        (res,) = llm.apply_model(collect)

    report = {"arch": args.arch, "layers": []}
    for idx in range(n_layers):
        steps = res["steps"][idx]
        per_step = {k: v / steps for k, v in sorted(res["counts"][idx].items())} if steps else {}
        ops_kernels = sum(v for k, v in per_step.items() if k.startswith("kernel "))
        attention = sum(v for k, v in per_step.items() if k == "attention op")
        other = sum(v for k, v in per_step.items() if k.startswith("aten."))
        report["layers"].append(
            {
                "layer": idx,
                "decode_steps": steps,
                "total": ops_kernels + attention + other,
                "ops_layer_kernels": ops_kernels,
                "attention": attention,
                "other_aten": other,
                "breakdown": per_step,
            }
        )
    print(f"{args.arch}: kernel calls per decoder layer per decode step (1 request, emulated device)")
    for lay in report["layers"]:
        print(
            f"  layer {lay['layer']} ({lay['decode_steps']} decode steps): total {lay['total']:.1f} = "
            f"{lay['ops_layer_kernels']:.1f} ops-layer kernels + {lay['attention']:.1f} attention + "
            f"{lay['other_aten']:.1f} other aten"
        )
        for k, v in lay["breakdown"].items():
            print(f"      {v:5.1f}  {k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
