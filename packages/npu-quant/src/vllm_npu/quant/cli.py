# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu quantize <hf-model-dir> <out-dir> --scheme W8A8|W8A8_DYNAMIC|W4A8_DYNAMIC|W4A4_FLATQUANT``.

Writes a msModelSlim-format checkpoint that vLLM loads with the ``ascend`` quant method (see
:mod:`vllm_npu.quant.quantizer`). For users and tests without msModelSlim.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-npu quantize",
        description="Quantize a Hugging Face causal LM into a msModelSlim-format checkpoint for the 'ascend' method.",
    )
    p.add_argument("model_dir", type=Path, help="HF checkpoint directory (config.json + safetensors + tokenizer)")
    p.add_argument("out_dir", type=Path, help="output directory (created)")
    p.add_argument("--scheme", required=True, choices=["W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A4_FLATQUANT"])
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="W4A8 per-group size (default: the largest of 256/128/64/32 dividing every input size)",
    )
    p.add_argument(
        "--w4a8-version",
        choices=["0", "1.0.0"],
        default="0",
        help="W4A8 disk format: 0 = one int4 per int8; 1.0.0 = two int4 per int8 (packed)",
    )
    p.add_argument("--clip-ratio", type=float, default=1.0, help="W4A4 activation clip ratio in (0, 1]")
    p.add_argument(
        "--calib-file",
        type=Path,
        default=None,
        help="W8A8 calibration prompts, one per line (default: a few built-in sentences)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the W4A4 FlatQuant transforms")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from .quantizer import QuantizeError, quantize_checkpoint

    if not (args.model_dir / "config.json").is_file():
        print(
            f"vllm-npu quantize: {args.model_dir} has no config.json; pass a Hugging Face checkpoint directory",
            file=sys.stderr,
        )
        return 2
    prompts = None
    if args.calib_file is not None:
        prompts = [line.strip() for line in args.calib_file.read_text().splitlines() if line.strip()]
        if not prompts:
            print(f"vllm-npu quantize: {args.calib_file} has no prompts", file=sys.stderr)
            return 2
    try:
        out = quantize_checkpoint(
            args.model_dir,
            args.out_dir,
            args.scheme,
            group_size=args.group_size,
            w4a8_version=args.w4a8_version,
            clip_ratio=args.clip_ratio,
            calibration=prompts,
            seed=args.seed,
        )
    except QuantizeError as exc:
        print(f"vllm-npu quantize: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.scheme} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
