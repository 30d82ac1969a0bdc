"""W8A8_DYNAMIC FusedMoE experts, plugged into npu-ops' MoE forward (gate -> dispatch -> experts -> combine).

Checkpoint tensors (vLLM's FusedMoE layout, loaded by ``FusedMoE.weight_loader`` from the per-expert
``experts.<e>.{gate,up,down}_proj.*`` tensors)::

    w13_weight [E, 2I, H] int8     w13_weight_scale [E, 2I, 1]   w13_weight_offset [E, 2I, 1] (must be 0)
    w2_weight  [E, H, I]  int8     w2_weight_scale  [E, H, 1]    w2_weight_offset  [E, H, 1]  (must be 0)

Expert maths for the rows routed to expert e (``dq`` = per-token dynamic int8 quant)::

    xq, s  = dq(x);   h = (xq @ W13[e]ᵀ) * s13[e] * s           (int8 grouped matmul, per-token dequant)
    hq, s' = dq(silu(h_gate) * h_up);   y = (hq @ W2[e]ᵀ) * s2[e] * s'

W4A8_DYNAMIC experts (disk format "0": int4 values in int8, ``*_weight_scale [E, N, 1]`` and per-group
``*_weight_scale_second [E, N, K/g]``) run weight-only, like the W4A8 linear path: ``npu_grouped_matmul`` in its
documented per-group antiquant mode (float rows, int4 weights packed 8 per int32, ``antiquant_scale [E, K/g, N]``).

Gating, token permutation and expert-parallel dispatch are npu-ops' (:func:`vllm_npu.ops.moe.forward.moe_forward`);
this module only supplies the quantized ``experts`` function. Load-time processing: transposes to ``[E, H, 2I]`` /
``[E, I, H]`` and flattening of the scales, in :meth:`process_weights_after_loading`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.layer import FusedMoEMethodBase, FusedMoeWeightScaleSupported
from vllm_npu.interface import Kernel, require

from . import kernels
from .params import FLOATS, QuantLoadError, replace_param

# --------------------------------------------------------------------------------------------------------------
# int8 grouped matmul with per-channel weight scales and per-token activation scales


def _grouped_qmm_npu(
    xq: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pertoken: torch.Tensor, counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_grouped_matmul(
        [xq], [weight], scale=[scale], per_token_scale=[pertoken], group_list=counts.to(torch.int64),
        split_item=2, group_type=0, group_list_type=1, output_dtype=out_dtype,
    )[0]


def _grouped_qmm_ref(
    xq: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pertoken: torch.Tensor, counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq int8 ``[N, K]`` (rows sorted by group), weight int8 ``[G, K, M]``, scale float32 ``[G, M]``, pertoken
    float32 ``[N]``, counts int64 ``[G]`` -> ``[N, M]``: ``(xq_g @ W[g]) * scale[g] * pertoken_g``."""
    sizes = counts.tolist()
    if len(sizes) != weight.shape[0] or sum(sizes) != xq.shape[0]:
        raise ValueError(f"grouped matmul: counts {sizes} do not fit {xq.shape[0]} rows / {weight.shape[0]} groups")
    out = torch.empty(xq.shape[0], weight.shape[-1], dtype=out_dtype, device=xq.device)
    start = 0
    for g, n in enumerate(sizes):
        if n:
            acc = xq[start:start + n].to(torch.float64) @ weight[g].to(torch.float64)  # exact for int8
            res = acc.to(torch.float32) * scale[g].to(torch.float32) * pertoken[start:start + n].unsqueeze(-1)
            out[start:start + n] = res.to(out_dtype)
        start += n
    return out


grouped_quant_matmul = Kernel("npu_grouped_matmul[int8,per-token]", npu=_grouped_qmm_npu, reference=_grouped_qmm_ref)


class W8A8DynamicExperts:
    """The :data:`vllm_npu.ops.moe.experts.ExpertsFn` over processed weights (w13 [E, H, 2I], w2 [E, I, H])."""

    def __init__(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.layer = layer
        self.activation = activation
        self._dq = kernels.dynamic_quant.select()
        self._gqmm = grouped_quant_matmul.select()

    def __call__(self, rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        xq, s = self._dq(rows)
        h = self._gqmm(xq, layer.w13_weight, layer.w13_weight_scale, s, group_counts, rows.dtype)
        hq, s2 = self._dq(self.activation(h))
        return self._gqmm(hq, layer.w2_weight, layer.w2_weight_scale, s2, group_counts, rows.dtype)


def _grouped_w4_npu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_grouped_matmul(
        [x], [weight], antiquant_scale=[scale], group_list=counts.to(torch.int64), split_item=2, group_type=0,
        group_list_type=1,
    )[0]


def _grouped_w4_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x ``[N, K]`` float (rows sorted by group), weight int32 ``[G, K, M/8]`` (int4), scale ``[G, K/g, M]`` in x's
    dtype, counts ``[G]`` -> ``[N, M]``: ``x_g @ (W4[g] * scale[g][k // group])``."""
    sizes = counts.tolist()
    if len(sizes) != weight.shape[0] or sum(sizes) != x.shape[0]:
        raise ValueError(f"grouped matmul: counts {sizes} do not fit {x.shape[0]} rows / {weight.shape[0]} groups")
    k = weight.shape[1]
    group = k // scale.shape[1]
    out = torch.empty(x.shape[0], weight.shape[-1] * 8, dtype=x.dtype, device=x.device)
    start = 0
    for g, n in enumerate(sizes):
        if n:
            w = kernels.unpack_int4(weight[g]).to(torch.float32) * scale[g].to(torch.float32).repeat_interleave(group, 0)
            out[start:start + n] = (x[start:start + n].to(torch.float32) @ w).to(x.dtype)
        start += n
    return out


grouped_w4_matmul = Kernel("npu_grouped_matmul[int4 antiquant,per-group]", npu=_grouped_w4_npu, reference=_grouped_w4_ref)


class W4A8DynamicExperts:
    """Weight-only int4 experts over processed weights (w13 [E, H, 2I/8], w2 [E, I, H/8] int32)."""

    def __init__(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.layer = layer
        self.activation = activation
        self._gmm = grouped_w4_matmul.select()

    def __call__(self, rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        h = self._gmm(rows, layer.w13_weight, layer.w13_antiquant_scale.to(rows.dtype), group_counts)
        return self._gmm(self.activation(h), layer.w2_weight, layer.w2_antiquant_scale.to(rows.dtype), group_counts)


class AscendW8A8DynamicFusedMoEMethod(FusedMoEMethodBase):
    """W8A8_DYNAMIC experts for vLLM's ``FusedMoE`` (and npu-ops' override of it)."""

    _required = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")

    def __init__(self, moe: Any, prefix: str) -> None:
        super().__init__(moe)
        self.prefix = prefix
        self._loads: dict[str, set[tuple[int, str]]] = {}
        self._plan: Any = None
        self._experts: Any = None

    # --- weights ----------------------------------------------------------------------------------------------------
    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        from vllm.model_executor.utils import set_weight_attrs

        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        loader = extra_weight_attrs.pop("weight_loader")
        self.num_local_experts = e
        for name, shape, dtype, accept, attrs in self._specs(e, h, i):
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {**extra_weight_attrs, **attrs, "weight_loader": self._wrap(name, accept, dtype, loader)})

    def _specs(self, e: int, h: int, i: int) -> list[tuple[str, tuple[int, ...], torch.dtype, tuple[torch.dtype, ...], dict[str, Any]]]:
        channel = {"quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}
        return [
            ("w13_weight", (e, 2 * i, h), torch.int8, (torch.int8,), {}),
            ("w2_weight", (e, h, i), torch.int8, (torch.int8,), {}),
            ("w13_weight_scale", (e, 2 * i, 1), torch.float32, FLOATS, channel),
            ("w2_weight_scale", (e, h, 1), torch.float32, FLOATS, channel),
            ("w13_weight_offset", (e, 2 * i, 1), torch.float32, FLOATS, channel),
            ("w2_weight_offset", (e, h, 1), torch.float32, FLOATS, channel),
        ]

    def _wrap(self, name: str, accept: tuple[torch.dtype, ...], dtype: torch.dtype, inner: Callable[..., Any]) -> Callable[..., Any]:
        full = f"{self.prefix}.{name}"

        def load(param: torch.nn.Parameter, loaded: torch.Tensor, weight_name: str, shard_id: str, expert_id: int,
                 *args: Any, **kwargs: Any) -> Any:
            if loaded.dtype not in accept:
                raise QuantLoadError(
                    f"checkpoint tensor {weight_name!r} (-> {full}, expert {expert_id}, {shard_id}) has dtype "
                    f"{loaded.dtype}, expected one of {', '.join(map(str, accept))}; the checkpoint does not match its "
                    "quant_model_description.json: re-export it"
                )
            try:
                result = inner(param, loaded.to(dtype), weight_name, shard_id, expert_id, *args, **kwargs)
            except (AssertionError, RuntimeError) as exc:
                raise QuantLoadError(
                    f"checkpoint tensor {weight_name!r} (-> {full}, expert {expert_id}, {shard_id}) has shape "
                    f"{tuple(loaded.shape)}, which does not fit the expert slice of {tuple(param.shape)} ({exc})"
                ) from None
            if result is not False:
                self._loads.setdefault(name, set()).add((int(expert_id), str(shard_id)))
            return result

        return load

    def _check_complete(self) -> None:
        e = self.num_local_experts
        need = {n: (2 * e if n.startswith("w13") else e) for n in self._required}
        missing = [f"{self.prefix}.{n} ({len(self._loads.get(n, ()))}/{k} expert shards)" for n, k in need.items()
                   if len(self._loads.get(n, ())) < k]
        if missing:
            raise QuantLoadError(
                f"the checkpoint does not provide all expert tensors that quant_model_description.json promises: "
                f"{', '.join(missing)}; re-export the checkpoint"
            )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_complete()
        for name in ("w13_weight_offset", "w2_weight_offset"):
            if name in self._loads and bool((getattr(layer, name) != 0).any()):
                raise QuantLoadError(f"{self.prefix}.{name} has non-zero values: asymmetric expert weights are not "
                                     "supported; re-export with symmetric quantization")
            del layer._parameters[name]
        for name in ("w13_weight_scale", "w2_weight_scale"):
            s = getattr(layer, name).data
            if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
                raise QuantLoadError(f"{self.prefix}.{name} must be finite and > 0")
            replace_param(layer, name, s.reshape(s.shape[0], -1).float().contiguous())  # [E, N]
        replace_param(layer, "w13_weight", layer.w13_weight.data.transpose(1, 2).contiguous())  # [E, H, 2I]
        replace_param(layer, "w2_weight", layer.w2_weight.data.transpose(1, 2).contiguous())  # [E, I, H]
        self._build(layer)

    def _build(self, layer: torch.nn.Module) -> None:
        """Choose every kernel once: npu-ops' plan (gate, dispatcher, activation; ``layer.moe_plan`` when the layer
        is npu-ops' AscendFusedMoE, else built the same way) plus our quantized experts."""
        plan = getattr(layer, "moe_plan", None)
        if plan is None:
            try:
                from vllm_npu.ops.moe.layer import build_layer_plan
            except ImportError:
                require("ops", "W8A8_DYNAMIC MoE experts run inside npu-ops' MoE forward")
                raise
            plan = build_layer_plan(layer)
        self._plan = plan
        self._experts = self._make_experts(layer, plan.activation)

    def _make_experts(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return W8A8DynamicExperts(layer, activation)

    # --- forward ----------------------------------------------------------------------------------------------------
    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None  # our experts do not run through vLLM's modular kernels

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
              renormalize: bool, *args: Any, **kwargs: Any) -> torch.Tensor:
        from vllm_npu.ops.moe.forward import moe_forward

        if self._plan is None or self._experts is None:
            raise RuntimeError(f"{self.prefix}: process_weights_after_loading has not run")
        if kwargs.get("enable_eplb"):
            raise NotImplementedError(f"EPLB is not supported with {type(self).__name__}")
        return moe_forward(x, router_logits, plan=self._plan, experts=self._experts,
                           e_score_correction_bias=kwargs.get("e_score_correction_bias"))


class AscendW4A8DynamicFusedMoEMethod(AscendW8A8DynamicFusedMoEMethod):
    """W4A8_DYNAMIC experts (disk format "0"), run weight-only through the per-group int4 grouped matmul."""

    _required = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_weight_scale_second",
                 "w2_weight_scale_second")

    def __init__(self, moe: Any, prefix: str, group_size: int, version: str) -> None:
        super().__init__(moe, prefix)
        if version != "0":
            raise QuantLoadError(
                f"{prefix}: W4A8_DYNAMIC experts in the packed format (version {version!r}) are not supported by "
                "npu-quant yet; export the experts with version 0 (one int4 value per int8)"
            )
        if group_size <= 0:
            raise QuantLoadError(f"{prefix}: W4A8_DYNAMIC experts need a per-group checkpoint (group_size > 0)")
        self.group_size = group_size

    def _specs(self, e: int, h: int, i: int) -> list[tuple[str, tuple[int, ...], torch.dtype, tuple[torch.dtype, ...], dict[str, Any]]]:
        g = self.group_size
        if h % g or i % g or h % 8 or i % 8:
            raise QuantLoadError(
                f"{self.prefix}: hidden {h} and expert width {i} (per rank) must be multiples of group_size {g} and "
                "of 8 for int4 experts"
            )
        group = {"quant_method": FusedMoeWeightScaleSupported.GROUP.value}
        return super()._specs(e, h, i) + [
            ("w13_weight_scale_second", (e, 2 * i, h // g), torch.float32, FLOATS, group),
            ("w2_weight_scale_second", (e, h, i // g), torch.float32, FLOATS, group),
            ("w13_weight_offset_second", (e, 2 * i, h // g), torch.float32, FLOATS, group),
            ("w2_weight_offset_second", (e, h, i // g), torch.float32, FLOATS, group),
        ]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_complete()
        for name in ("w13_weight_offset", "w2_weight_offset", "w13_weight_offset_second", "w2_weight_offset_second"):
            if name in self._loads and bool((getattr(layer, name) != 0).any()):
                raise QuantLoadError(f"{self.prefix}.{name} has non-zero values: asymmetric expert weights are not "
                                     "supported; re-export with symmetric quantization")
            del layer._parameters[name]
        pack = kernels.int4pack.select()
        for w in ("w13", "w2"):
            weight = getattr(layer, f"{w}_weight").data
            if weight.numel() and (int(weight.min()) < -8 or int(weight.max()) > 7):
                raise QuantLoadError(f"{self.prefix}.{w}_weight (int4 values) must hold values in [-8, 7]")
            s1, s2 = getattr(layer, f"{w}_weight_scale").data.float(), getattr(layer, f"{w}_weight_scale_second").data.float()
            if not bool(torch.isfinite(s1 * s2).all()) or not bool((s1 * s2 > 0).all()):
                raise QuantLoadError(f"{self.prefix}.{w}_weight_scale / _second must be finite and > 0")
            # [E, N, K] int4 -> [E, K, N/8] int32 (the int4pack op is 2-D: one expert at a time)
            packed = torch.stack([pack(weight[e].t().contiguous().to(torch.int32)) for e in range(weight.shape[0])])
            replace_param(layer, f"{w}_weight", packed)
            replace_param(layer, f"{w}_antiquant_scale", (s1 * s2).transpose(1, 2).contiguous())  # [E, K/g, N]
            for name in (f"{w}_weight_scale", f"{w}_weight_scale_second"):
                del layer._parameters[name]
        self._build(layer)

    def _make_experts(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return W4A8DynamicExperts(layer, activation)
