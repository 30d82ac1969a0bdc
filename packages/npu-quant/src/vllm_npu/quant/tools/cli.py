# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu quantize <hf-model-dir> <out-dir> --scheme W8A8|W8A8_DYNAMIC|W4A8_DYNAMIC|W4A4_FLATQUANT``.

Writes a msModelSlim-format checkpoint that vLLM loads with the ``ascend`` quant method (see
:mod:`vllm_npu.quant.tools.quantizer`). For users and tests without msModelSlim.

Never damages the user's files: the input is only read; an output that is the input, inside it or around it, a
non-empty directory (unless ``--overwrite``) and an already-quantized input are refused before anything is read;
the output appears in one rename at the end (an error or Ctrl-C leaves nothing half-written). An option that does not
apply to the chosen scheme is refused rather than ignored.
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
    p.add_argument("out_dir", type=Path, help="output directory (created; must be new or empty unless --overwrite)")
    p.add_argument("--scheme", required=True, choices=["W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A4_FLATQUANT"])
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty output directory (never the input, nor a directory inside or around it)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="W4A8 per-group size (default: the largest of 256/128/64/32 dividing every input size)",
    )
    p.add_argument(
        "--w4a8-version",
        choices=["0", "1.0.0"],
        default=None,
        help="W4A8 disk format: 0 (default) = one int4 per int8; 1.0.0 = two int4 per int8 (packed)",
    )
    p.add_argument("--clip-ratio", type=float, default=None, help="W4A4 activation clip ratio in (0, 1] (default 1)")
    p.add_argument(
        "--calib-file",
        type=Path,
        default=None,
        help="W8A8 calibration prompts, one per line (default: a few built-in sentences)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the W4A4 FlatQuant transforms (default 0)")
    p.add_argument(
        "--kv-cache",
        choices=["C8"],
        default=None,
        help="also quantize the KV cache: C8 = int8 with per-channel K/V scales calibrated on the calibration "
        "prompts (--calib-file or the built-in ones); any --scheme",
    )
    return p


#: Options that apply to one scheme only: (attribute, flag, the scheme it applies to).
_SCHEME_OPTIONS = (
    ("group_size", "--group-size", "W4A8_DYNAMIC"),
    ("w4a8_version", "--w4a8-version", "W4A8_DYNAMIC"),
    ("clip_ratio", "--clip-ratio", "W4A4_FLATQUANT"),
    ("seed", "--seed", "W4A4_FLATQUANT"),
    ("calib_file", "--calib-file", "W8A8"),
)


def _misplaced_option(args: argparse.Namespace) -> str | None:
    for attr, flag, scheme in _SCHEME_OPTIONS:
        if attr == "calib_file" and args.kv_cache is not None:
            continue  # the KV-cache calibration reads it with any scheme
        if getattr(args, attr) is not None and args.scheme != scheme:
            return f"{flag} applies only to --scheme {scheme}, not {args.scheme}; drop it"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from .quantizer import QuantizeError, quantize_checkpoint

    def fail(message: str) -> int:
        print(f"vllm-npu quantize: {message}", file=sys.stderr)
        return 2

    misplaced = _misplaced_option(args)
    if misplaced:
        return fail(misplaced)
    prompts = None
    if args.calib_file is not None:
        try:
            text = args.calib_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            return fail(f"cannot read the calibration file {args.calib_file}: {exc}")
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
        if not prompts:
            return fail(f"{args.calib_file} has no prompts")
    try:
        quantize_checkpoint(
            args.model_dir,
            args.out_dir,
            args.scheme,
            group_size=args.group_size,
            w4a8_version=args.w4a8_version or "0",
            clip_ratio=1.0 if args.clip_ratio is None else args.clip_ratio,
            calibration=prompts,
            seed=args.seed or 0,
            overwrite=args.overwrite,
            kv_cache=args.kv_cache,
        )
    except QuantizeError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print(f"vllm-npu quantize: interrupted; {args.out_dir} was left as it was", file=sys.stderr)
        return 130
    kv = f" with a {args.kv_cache} KV cache" if args.kv_cache else ""
    print(f"wrote {args.scheme} checkpoint{kv} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
