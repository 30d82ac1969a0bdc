# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Vision-encoder time per image: npu-models' Qwen VL override (reference twins) vs vLLM's eager tower (TORCH_SDPA).

One vLLM vision tower per architecture (``--arch`` qwen2_vl / qwen2_5_vl / qwen3_vl) with random weights, shaped like
the released towers but shallower (``--depth`` blocks, ``--heads`` heads of dim ``--head-dim``, 80 by default as in
Qwen2/2.5-VL, so the override pads it to 128), and a twin converted by ``adopt_vision_attention`` +
``pad_vision_heads`` (what the model overrides do), and an unpadded twin (to separate the padding's cost from the
kernels'). All encode the same batch of ``--images`` images of
``--size`` x ``--size`` pixels; the outputs are checked equal (the benchmark refuses to time a wrong answer).

What the ratio means: on the CPU the override's attention is the reference twin of ``_npu_flash_attention_unpad``
(per-sequence fp32 softmax) on padded heads (128 lanes instead of 80) and its rotary the reference twin of
``npu_rotary_mul``; vLLM's eager path is one SDPA call per sequence at the original head dim. So the ratio is what the
emulated device pays for running the NPU code path, not an NPU number. Timing: ``--repeats`` rounds after a warm-up,
each timing one encoder forward of every variant in turn; medians in milliseconds per image, and the median of the
per-round ratios (robust to load changes on a shared host).

Run: ``.venv/bin/python benchmarks/vision_encoder.py [--arch qwen2_5_vl] [--threads 2] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _tower(arch: str, args: argparse.Namespace) -> tuple[Any, Any]:
    import transformers

    width = args.heads * args.head_dim
    if arch == "qwen2_vl":
        from vllm.model_executor.models.qwen2_vl import Qwen2VisionTransformer

        cfg = transformers.Qwen2VLConfig(
            vision_config={"depth": args.depth, "embed_dim": width, "hidden_size": 256, "num_heads": args.heads}
        ).vision_config
        return Qwen2VisionTransformer(cfg), cfg
    if arch == "qwen2_5_vl":
        from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionTransformer

        cfg = transformers.Qwen2_5_VLConfig(
            vision_config={
                "depth": args.depth,
                "hidden_size": width,
                "intermediate_size": 2 * width,
                "num_heads": args.heads,
                "out_hidden_size": 256,
                "fullatt_block_indexes": list(range(args.depth - 1, args.depth)),
            }
        ).vision_config
        return Qwen2_5_VisionTransformer(cfg), cfg
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    cfg = transformers.Qwen3VLConfig(
        vision_config={
            "depth": args.depth,
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_heads": args.heads,
            "out_hidden_size": 256,
            "deepstack_visual_indexes": [0],
        }
    ).vision_config
    return Qwen3_VisionTransformer(cfg), cfg


def _randomise(torch: Any, tower: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _interleaved(fns: list[Any], repeats: int, images: int) -> tuple[float, float, float, float]:
    """Each round times every ``fn`` once, in turn (after one warm-up round), so load changes on a shared host hit
    all alike: the median ms per image of each, and the median over rounds of ``fns[1] / fns[0]``."""
    for fn in fns:
        fn()
    rounds = []
    for _ in range(repeats):
        row = []
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            row.append((time.perf_counter() - t0) * 1e3 / images)
        rounds.append(row)
    medians = [statistics.median(r[i] for r in rounds) for i in range(len(fns))]
    return medians[0], medians[1], medians[2], statistics.median(r[1] / r[0] for r in rounds)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from npu_testkit.distributed import single_rank_group
    from vllm_npu.interface import configure_kernels
    from vllm_npu.models.vision import adopt_vision_attention, pad_vision_heads

    torch.set_num_threads(args.threads)
    configure_kernels("reference")
    rows = []
    with single_rank_group():
        for arch in args.arch:
            vllm_tower, cfg = _tower(arch, args)
            ours, _ = _tower(arch, args)
            unpadded, _ = _tower(arch, args)
            for tower in (vllm_tower, ours, unpadded):
                _randomise(torch, tower, 0)
            adopt_vision_attention(ours, pad_head_dim=arch != "qwen3_vl")
            adopt_vision_attention(unpadded, pad_head_dim=False)
            padded = pad_vision_heads(ours)
            patches = args.size // cfg.patch_size
            grid = [[1, patches, patches]] * args.images
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(
                args.images * patches * patches, 3 * cfg.temporal_patch_size * cfg.patch_size**2, generator=gen
            )
            with torch.inference_mode():
                want = vllm_tower(x, grid_thw=grid)
                torch.testing.assert_close(ours(x, grid_thw=grid), want, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(unpadded(x, grid_thw=grid), want, rtol=1e-4, atol=1e-4)
                vllm_ms, ours_ms, unpadded_ms, ratio = _interleaved(
                    [
                        lambda: vllm_tower(x, grid_thw=grid),
                        lambda: ours(x, grid_thw=grid),
                        lambda: unpadded(x, grid_thw=grid),
                    ],
                    args.repeats,
                    args.images,
                )
            rows.append(
                {
                    "arch": arch,
                    "depth": args.depth,
                    "heads": args.heads,
                    "head_dim": args.head_dim,
                    "padded_to_128": padded > 0,
                    "image_px": args.size,
                    "patches_per_image": patches * patches,
                    "images": args.images,
                    "vllm_eager_ms_per_image": round(vllm_ms, 3),
                    "override_reference_ms_per_image": round(ours_ms, 3),
                    "override_unpadded_ms_per_image": round(unpadded_ms, 3),
                    "ratio": round(ratio, 3),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS))
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=80)
    ap.add_argument("--size", type=int, default=448, help="image side in pixels (a multiple of 28 / 32)")
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = run(args)
    for r in rows:
        print(
            f"{r['arch']:>11}: {r['patches_per_image']} patches/image, head dim {r['head_dim']}"
            f"{' (padded to 128)' if r['padded_to_128'] else ''}: vLLM eager {r['vllm_eager_ms_per_image']} ms, "
            f"override {r['override_reference_ms_per_image']} ms per image (x{r['ratio']}; unpadded "
            f"{r['override_unpadded_ms_per_image']} ms)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
