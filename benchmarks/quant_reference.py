# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Time of npu-quant's linear schemes with the reference kernels (the emulated device), against a float linear.

For each scheme and token count it builds one ``[N, K]`` layer through the real ``AscendLinearMethod`` (weights from
the quantizer's maths, loaded through the validating loaders, processed once), then times ``apply``:

- ``float``: ``torch.nn.functional.linear`` (what an unquantized layer costs on the CPU);
- ``W8A8`` / ``W8A8_DYNAMIC`` / ``W4A8_DYNAMIC`` / ``W4A4_FLATQUANT``: the scheme's forward with the reference
  kernels (int32 integer matmuls, int4 unpacking), i.e. what the emulated device pays per quantized layer.

Timing: median of ``--repeats`` runs after a warm-up, in milliseconds per call. Reference-kernel numbers on the CPU,
not NPU numbers: they size the emulated device's test runs and catch regressions in the reference twins.

Run: ``.venv/bin/python benchmarks/quant_reference.py [--k 1024] [--n 1024] [--tokens 1,8,128,512] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

from _timing import median_ms

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch  # noqa: E402

SCHEMES = ["W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A4_FLATQUANT_DYNAMIC"]


def build(scheme: str, w: torch.Tensor, x_calib: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm_npu.quant.description import QuantDescription
    from vllm_npu.quant.linear_method import AscendLinearMethod
    from vllm_npu.quant.schemes import make_linear_scheme
    from vllm_npu.quant.tools.quantize_math import (
        flatquant_transforms,
        quantize_w4a4_flatquant,
        quantize_w4a8,
        quantize_w8a8,
        quantize_w8a8_dynamic,
    )

    n, k = w.shape
    if scheme == "W8A8":
        tensors = quantize_w8a8(w, None, float(x_calib.min()), float(x_calib.max()), torch.float32)
    elif scheme == "W8A8_DYNAMIC":
        tensors = quantize_w8a8_dynamic(w, torch.float32)
    elif scheme == "W4A8_DYNAMIC":
        tensors = quantize_w4a8(w, 128, "0", False, torch.float32)
    else:
        left, right = flatquant_transforms(k)
        tensors = quantize_w4a4_flatquant(w, left, right, 1.0, torch.float32)
    desc = QuantDescription.from_mapping({f"bench.{s}": scheme for s in tensors} | {"group_size": 128})
    method = AscendLinearMethod(make_linear_scheme(scheme, desc), "bench")
    layer = torch.nn.Module()
    layer.params_dtype = torch.float32
    method.create_weights(layer, k, [n], k, n, torch.float32, weight_loader=default_weight_loader)
    params = dict(layer.named_parameters())
    for suffix, t in tensors.items():
        params[suffix].weight_loader(params[suffix], t)
    method.process_weights_after_loading(layer)
    return lambda x: method.apply(layer, x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--tokens", default="1,8,128,512")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    w = torch.randn(args.n, args.k) * 0.05
    calib = torch.randn(64, args.k)
    layers = {"float": lambda x: torch.nn.functional.linear(x, w)}
    layers.update({s: build(s, w, calib) for s in SCHEMES})
    results = []
    with torch.no_grad():
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, args.k)
            row = {"tokens": t}
            for name, fn in layers.items():
                row[name] = round(median_ms(lambda fn=fn, x=x: fn(x), args.repeats), 3)
            results.append(row)
            print(f"T={t:5d}  " + "  ".join(f"{k}={v:8.3f}ms" for k, v in row.items() if k != "tokens"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"k": args.k, "n": args.n, "threads": args.threads, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
