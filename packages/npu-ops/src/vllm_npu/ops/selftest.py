# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest`` cases for the ops layer's kernel pairs (see :mod:`vllm_npu.interface.selftest`).

Sizes are the ones models send: hidden 4096 (Llama/Qwen) and 7168 (DeepSeek-V3), the MLA latent 512 and q LoRA
1536, rope widths 64 and 128, Qwen2-VL's MRoPE sections ``[16, 24, 24]``, DeepSeek-V3's 256 experts in 8 groups
(top-8 of the best 4 groups) and Qwen-MoE's softmax top-8 of 128. Dtypes are the ones each torch_npu op documents.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from vllm_npu.interface import KernelCall, KernelCase, is_310p, randn, randperm

from .activation import FAST_GELU
from .layernorm import ADD_RMS_NORM, GEMMA_RMS_NORM, RMS_NORM
from .lora.kernels import BGMV_EXPAND, BGMV_SHRINK, SGMV_EXPAND, SGMV_SHRINK
from .moe.experts import GROUPED_MATMUL
from .moe.gating import GROUPED_TOPK, TOPK_SOFTMAX
from .moe.mc2 import MC2_COMBINE, MC2_DISPATCH
from .moe.routing import FINALIZE_ROUTING, INIT_ROUTING, UNPERMUTE
from .mrope import MROPE
from .rotary_embedding import ROTARY_MUL, ROTARY_MUL_QK
from .swiglu import SWIGLU

FLOATS = ("bfloat16", "float16", "float32")
HALVES = ("bfloat16", "float16")
_EPS = 1e-6


def _dt(name: str) -> torch.dtype:
    return getattr(torch, name)


def _norm_cases() -> list[KernelCase]:
    cases = []
    for tokens, hidden in ((7, 512), (33, 4096), (5, 7168)):
        for dtype in FLOATS:

            def norm(device: Any, t: int = tokens, h: int = hidden, d: str = dtype) -> KernelCall:
                return KernelCall(
                    (
                        randn(1, t, h, dtype=_dt(d), device=device),
                        randn(2, h, dtype=_dt(d), device=device, scale=0.2) + 1,
                        _EPS,
                    ),
                    {},
                )

            def add_norm(device: Any, t: int = tokens, h: int = hidden, d: str = dtype) -> KernelCall:
                x1, x2 = randn(3, t, h, dtype=_dt(d), device=device), randn(4, t, h, dtype=_dt(d), device=device)
                return KernelCall((x1, x2, randn(5, h, dtype=_dt(d), device=device, scale=0.2) + 1, _EPS), {})

            def gemma(device: Any, t: int = tokens, h: int = hidden, d: str = dtype) -> KernelCall:
                # Gemma stores gamma - 1: small values around 0
                return KernelCall(
                    (
                        randn(6, t, h, dtype=_dt(d), device=device),
                        randn(7, h, dtype=_dt(d), device=device, scale=0.2),
                        _EPS,
                    ),
                    {},
                )

            shape = f"x [{tokens}, {hidden}]"
            cases += [
                KernelCase(RMS_NORM, shape, dtype, norm),
                KernelCase(ADD_RMS_NORM, shape, dtype, add_norm),
                KernelCase(GEMMA_RMS_NORM, shape, dtype, gemma),
            ]
    return cases


def _activation_cases() -> list[KernelCase]:
    cases = []
    for tokens, inter in ((7, 256), (16, 1408)):
        for dtype in FLOATS:

            def swiglu(device: Any, t: int = tokens, i: int = inter, d: str = dtype) -> KernelCall:
                return KernelCall((randn(8, t, 2 * i, dtype=_dt(d), device=device),), {})

            cases.append(KernelCase(SWIGLU, f"x [{tokens}, {2 * inter}]", dtype, swiglu))
    for dtype in FLOATS:

        def gelu(device: Any, d: str = dtype) -> KernelCall:
            return KernelCall((randn(9, 9, 1280, dtype=_dt(d), device=device, scale=2.0),), {})

        cases.append(KernelCase(FAST_GELU, "x [9, 1280]", dtype, gelu, note="QuickGELU (vision towers)"))
    return cases


def _angles(seed: int, tokens: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    theta = randn(seed, tokens, half, dtype=torch.float32, device="cpu", scale=3.0)
    return theta.cos(), theta.sin()


def _rope_cases() -> list[KernelCase]:
    cases = []
    for tokens, heads, rot in ((7, 32, 128), (19, 16, 64)):
        for mode in ("half", "interleave"):
            for dtype in FLOATS:

                def rope(device: Any, t: int = tokens, n: int = heads, r: int = rot, m: str = mode, d: str = dtype):
                    c, s = _angles(10, t, r // 2)
                    rep = (lambda v: torch.cat((v, v), -1)) if m == "half" else (lambda v: v.repeat_interleave(2, -1))
                    cos = rep(c).view(1, t, 1, r).to(device=device, dtype=_dt(d))
                    sin = rep(s).view(1, t, 1, r).to(device=device, dtype=_dt(d))
                    return KernelCall((randn(11, 1, t, n, r, dtype=_dt(d), device=device), cos, sin, m), {})

                cases.append(KernelCase(ROTARY_MUL, f"x [1, {tokens}, {heads}, {rot}] {mode}", dtype, rope))
    for adjacent in (True, False):
        for dtype in FLOATS:
            # q and k as slices of one qkv-like buffer (the layer's layout: the twin rotates both in one pass over a
            # view) and as separate tensors (the twin concatenates).
            def rope_qk(device: Any, adj: bool = adjacent, d: str = dtype) -> KernelCall:
                t, n, nkv, r = 7, 16, 4, 128
                c, s = _angles(16, t, r // 2)
                cos = torch.cat((c, c), -1).view(1, t, 1, r).to(device=device, dtype=_dt(d))
                sin = torch.cat((s, s), -1).view(1, t, 1, r).to(device=device, dtype=_dt(d))
                if adj:
                    qk = randn(17, 1, t, n + nkv, r, dtype=_dt(d), device=device)
                    q, k = qk[:, :, :n], qk[:, :, n:]
                else:
                    q = randn(17, 1, t, n, r, dtype=_dt(d), device=device)
                    k = randn(18, 1, t, nkv, r, dtype=_dt(d), device=device)
                return KernelCall((q, k, cos, sin, "half"), {})

            layout = "q,k slices of one buffer" if adjacent else "q,k separate"
            cases.append(KernelCase(ROTARY_MUL_QK, f"q [1, 7, 16, 128] k [1, 7, 4, 128] {layout}", dtype, rope_qk))
    for sections in ([16, 24, 24], None):
        for dtype in HALVES:

            def mrope(device: Any, sec: list[int] | None = sections, d: str = dtype) -> KernelCall:
                t, nq, nk, head, positions_max = 11, 8, 2, 128, 64
                c, s = _angles(12, positions_max, head // 2)
                cache = torch.cat((c, s), -1).to(device=device, dtype=_dt(d))
                gen = torch.Generator().manual_seed(13)
                pos = torch.randint(0, positions_max, (3, t) if sec else (t,), generator=gen).to(device)
                q = randn(14, t, nq * head, dtype=_dt(d), device=device)
                k = randn(15, t, nk * head, dtype=_dt(d), device=device)
                return KernelCall((pos, q, k, cache, head, sec or [0, 0, 0], "half"), {})

            label = "positions [3, 11] sections [16, 24, 24]" if sections else "positions [11]"
            cases.append(KernelCase(MROPE, f"{label}, q [11, 8*128], k [11, 2*128]", dtype, mrope, note="Qwen2-VL"))
    return cases


def _sorted_topk(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """Top-k (weights, ids) with each row ordered by id: the order of the k entries is not part of the contract."""
    weights, ids = result
    order = ids.long().argsort(dim=-1)
    return {"weights": weights.gather(1, order), "ids": ids.gather(1, order)}


def _gating_cases() -> list[KernelCase]:
    cases = []
    for experts, top_k, renorm in ((128, 8, False), (64, 6, True)):
        for dtype in ("bfloat16", "float32"):

            def softmax_topk(device: Any, e: int = experts, k: int = top_k, rn: bool = renorm, d: str = dtype):
                return KernelCall((randn(18, 13, e, dtype=_dt(d), device=device), k, rn), {}, _sorted_topk)

            cases.append(
                KernelCase(TOPK_SOFTMAX, f"logits [13, {experts}] top{top_k} renorm={renorm}", dtype, softmax_topk)
            )
    for with_bias in (True, False):
        for dtype in ("bfloat16", "float32"):

            def grouped(device: Any, b: bool = with_bias, d: str = dtype) -> KernelCall:
                bias = randn(19, 256, dtype=torch.float32, device=device, scale=0.1) if b else None
                kw = dict(top_k=8, num_expert_group=8, topk_group=4, scoring_func="sigmoid", routed_scaling_factor=2.5)
                return KernelCall((randn(20, 13, 256, dtype=_dt(d), device=device), bias), kw, _sorted_topk)

            label = "logits [13, 256] 8 groups top4 -> top8 sigmoid" + (" + bias" if with_bias else "")
            cases.append(KernelCase(GROUPED_TOPK, label, dtype, grouped, note="DeepSeek-V3 noaux_tc"))
    return cases


def _routing_ids(device: Any, tokens: int, top_k: int, experts: int) -> torch.Tensor:
    """Distinct expert ids per token (what a top-k gives), int32 ``[tokens, top_k]``."""
    return torch.stack([randperm(21 + t, experts, "cpu")[:top_k] for t in range(tokens)]).to(torch.int32).to(device)


def _valid_routing(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    expanded_x, row_idx, counts = result
    n = int(counts.sum())  # rows past the in-range ones are undefined on the NPU
    return {"expanded_x": expanded_x[:n], "expanded_row_idx": row_idx[:n], "counts": counts}


def _moe_cases() -> list[KernelCase]:
    cases = []
    for dtype in HALVES:

        def gmm(device: Any, d: str = dtype) -> KernelCall:
            counts = torch.tensor([5, 0, 9, 3], dtype=torch.int64)
            x = randn(22, int(counts.sum()), 256, dtype=_dt(d), device=device)
            # the transposed view of vLLM's [G, M, K] parameter, as the layer passes it
            w = randn(23, 4, 384, 256, dtype=_dt(d), device=device, scale=1 / math.sqrt(256)).transpose(1, 2)
            return KernelCall((x, w, counts.to(device)), {})

        cases.append(KernelCase(GROUPED_MATMUL, "x [17, 256], W [4, 256, 384] (view), counts [5, 0, 9, 3]", dtype, gmm))
        for expert_range in ((0, 16), (4, 12)):

            def routing(device: Any, d: str = dtype, er: tuple[int, int] = expert_range) -> KernelCall:
                return KernelCall(
                    (randn(24, 9, 128, dtype=_dt(d), device=device), _routing_ids(device, 9, 4, 16), 16, er),
                    {},
                    _valid_routing,
                )

            cases.append(
                KernelCase(INIT_ROUTING, f"hidden [9, 128], ids [9, 4] of 16, range {expert_range}", dtype, routing)
            )

    def unpermute(device: Any) -> KernelCall:
        t, k, h = 9, 4, 256
        permuted = randn(25, t * k, h, dtype=torch.bfloat16, device=device)
        probs = torch.softmax(randn(26, t, k, dtype=torch.float32, device="cpu"), -1).to(torch.bfloat16).to(device)
        return KernelCall((permuted, randperm(27, t * k, device), probs), {})

    cases.append(KernelCase(UNPERMUTE, "permuted [36, 256], probs [9, 4]", "bfloat16", unpermute, note="bf16 only"))
    for dtype in FLOATS:  # the torchair graph's combine: every float dtype

        def finalize(device: Any, d: str = dtype) -> KernelCall:
            t, k, h = 9, 4, 256
            permuted = randn(28, t * k, h, dtype=_dt(d), device=device)
            probs = torch.softmax(randn(29, t, k, dtype=torch.float32, device="cpu"), -1).to(_dt(d)).to(device)
            return KernelCall((permuted, randperm(30, t * k, device), probs), {})

        cases.append(KernelCase(FINALIZE_ROUTING, "permuted [36, 256], probs [9, 4]", dtype, finalize))
    return cases


@functools.cache
def _mc2_comm(device_type: str) -> Any:
    """A one-rank MC2 group: identity exchange for the twin; on the NPU a one-rank HCCL group (made on first use)."""
    from .moe.mc2 import MC2Comm

    if device_type == "cpu":
        return MC2Comm(0, 1, lambda x, out_splits, in_splits: x.clone())
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("hccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    backend: Any = dist.group.WORLD._get_backend(torch.device("npu"))  # type: ignore[union-attr]  # ProcessGroupHCCL
    from vllm.platforms import current_platform

    soc = current_platform.device_backend.soc()
    return MC2Comm(0, 1, None, backend.get_hccl_comm_name(0), soc)


def _mc2_inputs(device: Any, dtype: str) -> tuple[Any, ...]:
    tokens, hidden, experts, k = 16, 1024, 16, 8  # a decode batch, Qwen3-MoE-like top-8 (of 16 here)
    x = randn(40, tokens, hidden, dtype=_dt(dtype), device=device)
    ids = _routing_ids(device, tokens, k, experts).to(torch.int32)
    return x, ids, _mc2_comm(torch.device(device).type), experts, 32


def _valid_dispatch(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    n = int(result.expert_token_nums.sum())  # rows past the valid ones are the kernel's own; assist info is opaque
    out = {"expand_x": result.expand_x[:n], "expert_token_nums": result.expert_token_nums}
    if args[5]:  # dynamic-quant mode: the per-row scales too
        out["dynamic_scales"] = result.dynamic_scales[:n]
    return out


def _mc2_cases() -> list[KernelCase]:
    note = "one rank (the kernels' EP sizes may start at 2 on some CANN releases; then this row reports their error)"
    cases = []
    for dtype in HALVES:
        for quant in (False, True):

            def dispatch(device: Any, d: str = dtype, q: bool = quant) -> KernelCall:
                return KernelCall((*_mc2_inputs(device, d), q), {}, _valid_dispatch)

            label = "x [16, 1024], ids [16, 8] of 16, capacity 32" + (", dynamic int8" if quant else "")
            cases.append(KernelCase(MC2_DISPATCH, label, dtype, dispatch, int_atol=1 if quant else 0, note=note))

        def combine(device: Any, d: str = dtype) -> KernelCall:
            x, ids, comm, experts, global_bs = _mc2_inputs(device, d)
            side = MC2_DISPATCH.npu if torch.device(device).type != "cpu" else MC2_DISPATCH.reference
            dispatched = side(x, ids, comm, experts, global_bs, False)
            out = randn(41, *dispatched.expand_x.shape, dtype=_dt(d), device=device)
            weights = torch.softmax(randn(42, *ids.shape, dtype=torch.float32, device=device), -1)
            return KernelCall((out, ids, dispatched, weights, comm, experts, global_bs), {})

        cases.append(
            KernelCase(MC2_COMBINE, "expert rows [256, 1024] back to [16, 1024], top-8", dtype, combine, note=note)
        )
    return cases


def _lora_y(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    return {"y": args[2]}  # the LoRA kernels write their output in place


def _lora_cases() -> list[KernelCase]:
    """Multi-LoRA shrink/expand at hidden 4096, rank 16, 4 slots; segments include an empty one and a no-LoRA one."""
    cases = []
    seg_lens, seg_loras = [5, 0, 9, 1, 3], [2, 0, -1, 3, 2]
    tokens, hidden, rank, slots = sum(seg_lens), 4096, 16, 4
    for dtype in FLOATS:

        def shrink(device: Any, d: str = dtype, segmented: bool = True) -> KernelCall:
            x = randn(30, tokens, hidden, dtype=_dt(d), device=device)
            w = randn(31, slots, 1, rank, hidden, dtype=_dt(d), device=device, scale=1 / math.sqrt(hidden))
            y = torch.zeros(tokens, rank, dtype=torch.float32, device=device)
            lens, loras = torch.tensor(seg_lens, device=device), torch.tensor(seg_loras, device=device)
            mapping = (lens, loras) if segmented else (torch.repeat_interleave(loras, lens),)
            return KernelCall((x, w, y, *mapping, 0.5), {}, _lora_y)

        def expand(device: Any, d: str = dtype, segmented: bool = True) -> KernelCall:
            x = randn(32, tokens, rank, dtype=torch.float32, device=device)
            w = randn(33, slots, 1, 1024, rank, dtype=_dt(d), device=device, scale=0.25)
            y = randn(34, tokens, 1536, dtype=_dt(d), device=device)
            lens, loras = torch.tensor(seg_lens, device=device), torch.tensor(seg_loras, device=device)
            mapping = (lens, loras) if segmented else (torch.repeat_interleave(loras, lens),)
            return KernelCall((x, w, y, *mapping, 256, 1024, True), {}, _lora_y)

        shape = f"x [{tokens}, {hidden}], A [{slots}, {rank}, {hidden}], segments {seg_lens} -> slots {seg_loras}"
        eshape = f"x [{tokens}, {rank}], B [{slots}, 1024, {rank}] into y[:, 256:1280] of [{tokens}, 1536]"
        cases += [
            KernelCase(SGMV_SHRINK, shape, dtype, shrink),
            KernelCase(BGMV_SHRINK, shape, dtype, functools.partial(shrink, d=dtype, segmented=False)),
            KernelCase(SGMV_EXPAND, eshape, dtype, expand),
            KernelCase(BGMV_EXPAND, eshape, dtype, functools.partial(expand, d=dtype, segmented=False)),
        ]
    return cases


def _cases_310p() -> list[KernelCase]:
    """The Ascend 310P's own sequences (:mod:`.chip_310p`), in its dtype; they run on any chip."""
    from .chip_310p import ADD_RMS_NORM_310P, SWIGLU_310P
    from .moe.routing import INIT_ROUTING_310P

    def add_norm(device: Any) -> KernelCall:
        x1, x2 = (randn(10 + i, 7, 1024, dtype=torch.float16, device=device) for i in range(2))
        return KernelCall((x1, x2, randn(12, 1024, dtype=torch.float16, device=device, scale=0.2) + 1, _EPS), {})

    def swiglu(device: Any) -> KernelCall:
        return KernelCall((randn(13, 16, 2816, dtype=torch.float16, device=device),), {})

    return [
        KernelCase(ADD_RMS_NORM_310P, "x [7, 1024]", "float16", add_norm, note="310P: add, then npu_rms_norm"),
        KernelCase(SWIGLU_310P, "x [16, 2816]", "float16", swiglu, note="310P: npu_swiglu in float32"),
        *(
            KernelCase(
                INIT_ROUTING_310P,
                f"hidden [9, 128], ids [9, 4] of 16, range {er}",
                "float16",
                functools.partial(_routing_310p, expert_range=er),
                note="310P: the MoE permutation in torch (float-key argsort, one-hot counts)",
            )
            for er in ((0, 16), (8, 16))
        ),
    ]


def _routing_310p(device: Any, expert_range: tuple[int, int]) -> KernelCall:
    hidden = randn(24, 9, 128, dtype=torch.float16, device=device)
    return KernelCall((hidden, _routing_ids(device, 9, 4, 16), 16, expert_range), {}, _valid_routing)


#: The pairs the plugin never calls on an Ascend 310P: the chip's own sequences replace the first two
#: (:mod:`.chip_310p`), its MoE gates, permutes and combines in torch (:func:`.moe.routing.init_routing_kernel`,
#: :func:`.moe.gating.gate_path`), and it has no MC2.
_NOT_ON_310P = (ADD_RMS_NORM, SWIGLU, TOPK_SOFTMAX, GROUPED_TOPK, INIT_ROUTING, UNPERMUTE, FINALIZE_ROUTING)


def selftest_cases() -> list[KernelCase]:
    """Every ops kernel pair over its grid of shapes and dtypes. On an Ascend 310P: the float16 rows of the pairs it
    runs (it serves float16 models only; the other pairs are A2/A3 kernels it never calls) and its own sequences."""
    common = [*_norm_cases(), *_activation_cases(), *_rope_cases()]
    if is_310p():
        runs = [c for c in [*common, *_moe_cases(), *_lora_cases()] if c.dtype == "float16"]
        return [*_cases_310p(), *(c for c in runs if not any(c.kernel is k for k in _NOT_ON_310P))]
    return [*_cases_310p(), *common, *_gating_cases(), *_moe_cases(), *_mc2_cases(), *_lora_cases()]
