# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Quantized FusedMoE experts (W8A8_DYNAMIC, W4A8_DYNAMIC, static W8A8), plugged into npu-ops' MoE forward
(gate -> dispatch -> experts -> combine).

Checkpoint tensors (vLLM's FusedMoE layout, loaded by ``FusedMoE.weight_loader`` from the per-expert
``experts.<e>.{gate,up,down}_proj.*`` tensors)::

    w13_weight [E, 2I, H] int8     w13_weight_scale [E, 2I, 1]   w13_weight_offset [E, 2I, 1] (must be 0)
    w2_weight  [E, H, I]  int8     w2_weight_scale  [E, H, 1]    w2_weight_offset  [E, H, 1]  (must be 0)

W4A8_DYNAMIC experts (disk format "0": int4 values in int8, ``*_weight_scale [E, N, 1]`` and per-group
``*_weight_scale_second [E, N, K/g]``; format "1.0.0": two int4 per int8 along N, ``w13_weight [E, I, H]``,
``w2_weight [E, H/2, I]``, plus ``w13_scale_bias [E, 2I, 1]`` / ``w2_scale_bias [E, H, 16/tp]``) run as vllm-ascend
v0.11.0 runs them on hardware: int8 rows x int4 weights with int64-packed per-group scales and a float32 scale bias
(:mod:`vllm_npu.quant.moe_w4a8`).

Gating, token permutation and expert-parallel dispatch are npu-ops' (:func:`vllm_npu.ops.moe.moe_forward`);
this module checks and processes the expert tensors and supplies the quantized ``experts`` function of
:mod:`vllm_npu.quant.moe_experts` (expert maths and kernels there). npu-ops is npu-quant's declared optional
dependency (extra ``moe`` in its pyproject): the import happens when a MoE layer is built, through the
``vllm_npu.ops.moe`` door, and a missing npu-ops is a :class:`~vllm_npu.interface.MissingComponentError` with the
install command. Every method here runs the layer's own plan and says so
(:class:`~vllm_npu.interface.protocols.LayerMoEPlanRunner`), so npu-ops' layer may give the plan its all-to-all
dispatcher under data-parallel attention; and each declares
:class:`~vllm_npu.interface.protocols.MoEGraphTraceable`, so in the torchair mode the layer is traced into the
compiled decode graph (where npu-ops' ``moe_graph_refusal`` admits its configuration). Load-time processing: transposes to
``[E, H, 2I]`` / ``[E, I, H]`` and flattening of the scales, in :meth:`process_weights_after_loading`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase, FusedMoeWeightScaleSupported
from vllm_npu.interface import require

from . import kernels
from .moe_experts import W8A8DynamicExperts, W8A8StaticExperts
from .moe_w4a8 import W4A8DynamicExperts, a8w4_bias, process_a8w4_expert_weight
from .params import FLOATS, QuantLoadError, param, replace_param
from .schemes.base import require_int_range, require_positive, require_zero_if_loaded

#: One expert tensor: (name, shape, dtype, dtypes accepted on disk, weight attrs).
_Spec = tuple[str, tuple[int, ...], torch.dtype, tuple[torch.dtype, ...], dict[str, Any]]
# the scale layouts vLLM's FusedMoE weight loader shards by
_CHANNEL = {"quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}
_GROUP = {"quant_method": FusedMoeWeightScaleSupported.GROUP.value}


class AscendW8A8DynamicFusedMoEMethod(FusedMoEMethodBase):
    """W8A8_DYNAMIC experts for vLLM's ``FusedMoE`` (and npu-ops' override of it)."""

    _required: tuple[str, ...] = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
    #: apply() runs ``layer.moe_plan`` (see :meth:`_build`): the LayerMoEPlanRunner contract of npu-interface.
    uses_layer_moe_plan: ClassVar[bool] = True
    #: apply() traces into a compiled decode graph (npu-interface's MoEGraphTraceable): the experts of every scheme
    #: here read nothing on the host, their reference grouped matmuls are registered ops (:mod:`.moe_experts`).
    traces_in_moe_graph: ClassVar[bool] = True
    #: vLLM's dynamic EPLB moves these experts (npu-interface's EplbMovableExperts): after processing, every tensor
    #: the experts read is a contiguous ``[E_local, ...]`` parameter of the layer (weights, scales, scale biases,
    #: static input scales/offsets, quant biases, the scales converted for the kernel) and nothing is cached beside.
    moves_with_eplb: ClassVar[bool] = True

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
            set_weight_attrs(
                param, {**extra_weight_attrs, **attrs, "weight_loader": self._wrap(name, accept, dtype, loader)}
            )

    def _specs(self, e: int, h: int, i: int) -> list[_Spec]:
        return [
            ("w13_weight", (e, 2 * i, h), torch.int8, (torch.int8,), {}),
            ("w2_weight", (e, h, i), torch.int8, (torch.int8,), {}),
            ("w13_weight_scale", (e, 2 * i, 1), torch.float32, FLOATS, _CHANNEL),
            ("w2_weight_scale", (e, h, 1), torch.float32, FLOATS, _CHANNEL),
            ("w13_weight_offset", (e, 2 * i, 1), torch.float32, FLOATS, _CHANNEL),
            ("w2_weight_offset", (e, h, 1), torch.float32, FLOATS, _CHANNEL),
        ]

    def _wrap(
        self, name: str, accept: tuple[torch.dtype, ...], dtype: torch.dtype, inner: Callable[..., Any]
    ) -> Callable[..., Any]:
        full = f"{self.prefix}.{name}"
        layer = getattr(inner, "__self__", None)

        def load(
            param: torch.nn.Parameter,
            loaded: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            if loaded.dtype not in accept:
                raise QuantLoadError(
                    f"checkpoint tensor {weight_name!r} (-> {full}, expert {expert_id}, {shard_id}) has dtype "
                    f"{loaded.dtype}, expected one of {', '.join(map(str, accept))}; the checkpoint does not match its "
                    "quant_model_description.json: re-export it"
                )
            expected = self._expected_expert_shape(name, param, str(shard_id), layer)
            if expected is not None and tuple(loaded.shape) != expected:
                raise QuantLoadError(
                    f"checkpoint tensor {weight_name!r} (-> {full}, expert {expert_id}, {shard_id}) has shape "
                    f"{tuple(loaded.shape)}, expected {expected}; check the expert sizes, group_size and the "
                    "checkpoint's scheme"
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

    def _expected_expert_shape(
        self, name: str, param: torch.nn.Parameter, shard_id: str, layer: Any
    ) -> tuple[int, ...] | None:
        """The shape one expert's checkpoint tensor must have, where vLLM's FusedMoE loader would otherwise narrow
        a too-large tensor silently (it slices every w1/w3/w2 tensor to the expert slice): without tensor
        parallelism, the expert slice of ``param`` (``param.shape[1:]``), w1/w3 each half of its first dim. Under
        tensor parallelism (the slice is a rank's share) and for per-expert values and quant biases (loaded by
        their own checked loaders), None."""
        if int(getattr(layer, "tp_size", 1) or 1) != 1 or param.dim() < 2:
            return None
        if name.endswith(("_input_scale", "_input_offset", "_quant_bias")):
            return None
        shape = tuple(int(d) for d in param.shape[1:])
        if shard_id in ("w1", "w3"):
            return (shape[0] // 2, *shape[1:])
        return shape

    def _check_complete(self) -> None:
        e = self.num_local_experts
        need = {n: (2 * e if n.startswith("w13") else e) for n in self._required}
        missing = [
            f"{self.prefix}.{n} ({len(self._loads.get(n, ()))}/{k} expert shards)"
            for n, k in need.items()
            if len(self._loads.get(n, ())) < k
        ]
        if missing:
            raise QuantLoadError(
                f"the checkpoint does not provide all expert tensors that quant_model_description.json promises: "
                f"{', '.join(missing)}; re-export the checkpoint"
            )

    def _drop_zero_offsets(self, layer: torch.nn.Module, names: tuple[str, ...]) -> None:
        """The expert kernels have no weight zero point: loaded offsets must be zero; then they are dropped."""
        loaded = set(self._loads)
        for name in names:
            require_zero_if_loaded(layer, name, loaded, f"{self.prefix}.{name}")
            del layer._parameters[name]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_complete()
        self._drop_zero_offsets(layer, ("w13_weight_offset", "w2_weight_offset"))
        for name in ("w13_weight_scale", "w2_weight_scale"):
            s = getattr(layer, name).data
            require_positive(s, f"{self.prefix}.{name}")
            replace_param(layer, name, s.reshape(s.shape[0], -1).float().contiguous())  # [E, N]
        replace_param(layer, "w13_weight", param(layer, "w13_weight").data.transpose(1, 2).contiguous())  # [E, H, 2I]
        replace_param(layer, "w2_weight", param(layer, "w2_weight").data.transpose(1, 2).contiguous())  # [E, I, H]
        self._build(layer)

    def _build(self, layer: torch.nn.Module) -> None:
        """Choose every kernel once: npu-ops' plan (gate, dispatcher, activation; ``layer.moe_plan`` when the layer
        is npu-ops' AscendFusedMoE, else built the same way) plus our quantized experts."""
        plan = getattr(layer, "moe_plan", None)
        if plan is None:
            try:
                from vllm_npu.ops.moe import build_layer_plan
            except ImportError:
                require("ops", "quantized MoE experts run inside npu-ops' MoE forward")
                raise
            if not isinstance(layer, FusedMoE):
                raise TypeError(
                    f"{self.prefix}: a MoE quant method needs a vLLM FusedMoE layer, got {type(layer).__name__}"
                )
            plan = build_layer_plan(layer)
        self._plan = plan
        self._experts = self._make_experts(layer, plan.activation)

    def _make_experts(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return W8A8DynamicExperts(layer, activation)

    # --- forward ----------------------------------------------------------------------------------------------------
    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None  # our experts do not run through vLLM's modular kernels

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        top_k: int,
        renormalize: bool,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        from vllm_npu.ops.moe import moe_forward  # importable: _build succeeded

        if self._plan is None or self._experts is None:
            raise RuntimeError(f"{self.prefix}: process_weights_after_loading has not run")
        return moe_forward(
            x,
            router_logits,
            plan=self._plan,
            experts=self._experts,
            e_score_correction_bias=kwargs.get("e_score_correction_bias"),
        )


class AscendW4A8DynamicFusedMoEMethod(AscendW8A8DynamicFusedMoEMethod):
    """W4A8_DYNAMIC experts (disk formats "0" and "1.0.0") as vllm-ascend v0.11.0 runs them: int8 rows x int4
    weights (:mod:`vllm_npu.quant.moe_w4a8`)."""

    _required = (
        "w13_weight",
        "w2_weight",
        "w13_weight_scale",
        "w2_weight_scale",
        "w13_weight_scale_second",
        "w2_weight_scale_second",
    )

    def __init__(self, moe: Any, prefix: str, group_size: int, version: str) -> None:
        super().__init__(moe, prefix)
        if version not in ("0", "1.0.0"):
            raise QuantLoadError(
                f"{prefix}: W4A8_DYNAMIC experts in format version {version!r} are not supported; npu-quant reads "
                "version '0' (one int4 value per int8) and '1.0.0' (two int4 values per int8)"
            )
        if group_size <= 0:
            raise QuantLoadError(f"{prefix}: W4A8_DYNAMIC experts need a per-group checkpoint (group_size > 0)")
        self.group_size = group_size
        self.packed = version == "1.0.0"
        tp = int(getattr(moe, "tp_size", 1) or 1)
        if self.packed and (tp > 16 or 16 % tp):
            raise QuantLoadError(
                f"{prefix}: packed W4A8_DYNAMIC experts (version 1.0.0) split w2_scale_bias [.., 16] over the MoE "
                f"tensor-parallel ranks; {tp} ranks do not divide 16: use a tensor-parallel size dividing 16 or "
                "expert parallelism"
            )
        self._scale_bias_cols = 16 // tp

    def _specs(self, e: int, h: int, i: int) -> list[_Spec]:
        g = self.group_size
        if h % g or i % g or h % 8 or i % 8:
            raise QuantLoadError(
                f"{self.prefix}: hidden {h} and expert width {i} (per rank) must be multiples of group_size {g} and "
                "of 8 for int4 experts"
            )
        specs = super()._specs(e, h, i) + [
            ("w13_weight_scale_second", (e, 2 * i, h // g), torch.float32, FLOATS, _GROUP),
            ("w2_weight_scale_second", (e, h, i // g), torch.float32, FLOATS, _GROUP),
            ("w13_weight_offset_second", (e, 2 * i, h // g), torch.float32, FLOATS, _GROUP),
            ("w2_weight_offset_second", (e, h, i // g), torch.float32, FLOATS, _GROUP),
        ]
        if not self.packed:
            return specs
        # version 1.0.0: two int4 values per int8 along the output dim (w13 [E, I, H] = 2I outputs, w2 [E, H/2, I]),
        # plus the scale_bias tensors: the kernel's bias (8 * sum_k W4 * scale, partial sums over 16 chunks of K for w2)
        packed: dict[str, _Spec] = {
            "w13_weight": ("w13_weight", (e, i, h), torch.int8, (torch.int8,), {}),
            "w2_weight": ("w2_weight", (e, h // 2, i), torch.int8, (torch.int8,), {}),
        }
        return [packed.get(spec[0], spec) for spec in specs] + [
            ("w13_scale_bias", (e, 2 * i, 1), torch.float32, FLOATS, _CHANNEL),
            ("w2_scale_bias", (e, h, self._scale_bias_cols), torch.float32, FLOATS, _GROUP),
        ]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """vllm-ascend v0.11.0's processing (``quantization/w4a8_dynamic.py:399-490``): int4 weights packed 8 per
        int32 along N (``[E, K, N/8]``), ``*_weight_scale`` int64 ``[E, K/g, N]`` (float16-rounded ``s1 * s2``),
        ``*_scale_bias`` float32 ``[E, N]`` (computed for version "0", the checkpoint's summed for "1.0.0")."""
        self._check_complete()
        self._drop_zero_offsets(
            layer, ("w13_weight_offset", "w2_weight_offset", "w13_weight_offset_second", "w2_weight_offset_second")
        )
        for w in ("w13", "w2"):
            weight = getattr(layer, f"{w}_weight").data
            if self.packed:
                # [E, N/2, K] two int4 per byte (row 2j low nibble) -> [E, N, K] one per int8; flattening E into the
                # row dim keeps the pairs, as every expert's N/2 packed rows are whole pairs
                e, half, k = weight.shape
                weight = kernels.unpack_int4_pairs_dim0(weight.reshape(e * half, k)).reshape(e, 2 * half, k)
            else:
                require_int_range(weight, -8, 7, f"{self.prefix}.{w}_weight (int4 values)")
            s1, s2 = getattr(layer, f"{w}_weight_scale").data, getattr(layer, f"{w}_weight_scale_second").data
            require_positive(s1.float() * s2.float(), f"{self.prefix}.{w}_weight_scale / _second")
            scale_bias = None
            if self.packed and f"{w}_scale_bias" in self._loads:
                scale_bias = getattr(layer, f"{w}_scale_bias").data
                self._check_scale_bias(f"{w}_scale_bias", scale_bias, a8w4_bias(weight, s1, s2))
            packed, scale, bias = process_a8w4_expert_weight(weight, s1, s2, scale_bias)
            # the kernel's scales are float16-rounded (as vllm-ascend's): one that underflows to 0 or overflows would
            # zero or blow up its weights' group
            rounded = kernels.decode_scale(scale)
            if not bool(torch.isfinite(rounded).all()) or not bool((rounded > 0).all()):
                raise QuantLoadError(
                    f"{self.prefix}.{w}_weight_scale * {w}_weight_scale_second leaves float16's range (min "
                    f"{float((s1.float() * s2.float()).min()):g}, max {float((s1.float() * s2.float()).max()):g}): "
                    "the int8 x int4 expert kernel takes these scales as float16; re-export the checkpoint with scales "
                    "in [6e-8, 65504]"
                )
            replace_param(layer, f"{w}_weight", packed)
            replace_param(layer, f"{w}_weight_scale", scale)
            replace_param(layer, f"{w}_scale_bias", bias)
            del layer._parameters[f"{w}_weight_scale_second"]
        self._build(layer)

    def _check_scale_bias(self, name: str, loaded: torch.Tensor, expected: torch.Tensor) -> None:
        """A version "1.0.0" scale bias goes to the kernel as is (vllm-ascend reads it unchecked); one far from
        ``8 * sum_k W4 * scale`` (what gives back the kernel's int4-split offset, :mod:`.moe_w4a8`) would shift every
        output, so it is refused, naming the fix. The 5% slack admits a bias computed from other roundings of the
        same scales. (A missing one is computed, as for version "0".)"""
        got = loaded.float().sum(-1)
        if not bool(torch.isfinite(got).all()):
            raise QuantLoadError(f"{self.prefix}.{name} must be finite")
        diff = float((got - expected).abs().max()) if got.numel() else 0.0
        if diff > 0.05 * float(expected.abs().max()) + 1e-6:
            raise QuantLoadError(
                f"{self.prefix}.{name} is not 8 * sum_k(weight * weight_scale * weight_scale_second), the bias the "
                f"int8 x int4 expert kernel needs (max difference {diff:.3g}); re-export the checkpoint with "
                "msModelSlim or `vllm-npu quantize`"
            )

    def _make_experts(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return W4A8DynamicExperts(layer, activation)


class AscendW8A8FusedMoEMethod(AscendW8A8DynamicFusedMoEMethod):
    """Static W8A8 experts: int8 weights, per-expert static int8 activations with a zero point, int32 quant bias.

    Per expert ``e`` and projection (``x_q = clamp(round(x / s_x[e] + o_x[e]))``, as the W8A8 linear scheme)::

        y = (x_q @ W_q[e]ᵀ + quant_bias[e]) * deq_scale[e]     deq_scale = s_x * s_w,  quant_bias = -o_x Σ_k W_q (+ bias)

    ``gate_proj`` and ``up_proj`` of one expert must share their input scale/offset (they read the same rows).
    ``quant_bias`` folds the input offset over the full input width, so the down projection cannot be split over
    tensor-parallel ranks (expert parallelism is fine): tp > 1 is refused at load with the fix named.
    """

    _required = (
        "w13_weight",
        "w2_weight",
        "w13_deq_scale",
        "w2_deq_scale",
        "w13_input_scale",
        "w2_input_scale",
        "w13_input_offset",
        "w2_input_offset",
        "w13_quant_bias",
        "w2_quant_bias",
    )
    _per_expert = ("w13_input_scale", "w2_input_scale", "w13_input_offset", "w2_input_offset")

    def _specs(self, e: int, h: int, i: int) -> list[_Spec]:
        deq_accept = (*FLOATS, torch.int64)
        return super()._specs(e, h, i) + [
            ("w13_deq_scale", (e, 2 * i), torch.int64, deq_accept, _CHANNEL),
            ("w2_deq_scale", (e, h), torch.int64, deq_accept, _CHANNEL),
            ("w13_input_scale", (e, 1), torch.float32, FLOATS, {}),
            ("w2_input_scale", (e, 1), torch.float32, FLOATS, {}),
            ("w13_input_offset", (e, 1), torch.float32, (torch.int8, *FLOATS), {}),
            ("w2_input_offset", (e, 1), torch.float32, (torch.int8, *FLOATS), {}),
            ("w13_quant_bias", (e, 2 * i), torch.int32, (torch.int32,), {}),
            ("w2_quant_bias", (e, h), torch.int32, (torch.int32,), {}),
        ]

    def _wrap(
        self, name: str, accept: tuple[torch.dtype, ...], dtype: torch.dtype, inner: Callable[..., Any]
    ) -> Callable[..., Any]:
        if name.endswith("_deq_scale"):
            # float32 (bf16 models) or the int64 npu_trans_quant_param form (fp16 models): kept as the int64 bits of
            # a float32 so both load exactly through the per-channel loader; decoded in process_weights_after_loading.
            base = super()._wrap(name, (torch.int64,), torch.int64, inner)

            def to_bits(
                param: torch.nn.Parameter, loaded: torch.Tensor, weight_name: str, *args: Any, **kwargs: Any
            ) -> Any:
                if loaded.dtype not in accept:
                    return base(param, loaded, weight_name, *args, **kwargs)  # raises, naming the tensor and dtype
                bits = loaded if loaded.dtype == torch.int64 else kernels.encode_scale(loaded)
                return base(param, bits, weight_name, *args, **kwargs)

            return to_bits
        if name in self._per_expert or name.endswith("_quant_bias"):
            return super()._wrap(name, accept, dtype, self._own_loader(name, inner))
        return super()._wrap(name, accept, dtype, inner)

    def _own_loader(self, name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        """vLLM's FusedMoE loader skips names without "weight"/"scale" and keeps only the last of w1/w3's input
        scales; these tensors are loaded here: per-expert values (w1 and w3 must agree) and quant biases (sharded
        along the output like the weights)."""
        layer = getattr(inner, "__self__", None)
        seen: dict[int, torch.Tensor] = {}

        def load(
            param: torch.nn.Parameter,
            loaded: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            local = int(expert_id) if layer is None else layer._map_global_expert_id_to_local_expert_id(int(expert_id))
            if local == -1:
                return False
            if name in self._per_expert:
                if loaded.numel() != 1:
                    raise QuantLoadError(
                        f"checkpoint tensor {weight_name!r} must hold one value, got shape {tuple(loaded.shape)}"
                    )
                value = loaded.reshape(1)
                if local in seen and not torch.equal(seen[local], value):
                    raise QuantLoadError(
                        f"{self.prefix}.{name}: expert {expert_id} has different gate_proj / up_proj values "
                        f"({float(seen[local])} vs {float(value)}); one grouped matmul reads both, so they must be "
                        "calibrated together: re-export the checkpoint"
                    )
                seen[local] = value
                param.data[local].copy_(value)
                return True
            tp_rank, tp_size = (0, 1) if layer is None else (int(layer.tp_rank), int(layer.tp_size))
            full = param.shape[1]
            if shard_id == "w2":
                if loaded.shape != (full,):
                    raise RuntimeError(f"quant bias {tuple(loaded.shape)} vs [{full}]")
                param.data[local].copy_(loaded)
                return True
            half = full // 2
            if loaded.shape != (half * tp_size,):
                raise RuntimeError(f"quant bias {tuple(loaded.shape)} vs [{half * tp_size}]")
            start = 0 if shard_id == "w1" else half
            param.data[local, start : start + half].copy_(loaded.narrow(0, tp_rank * half, half))
            return True

        return load

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_complete()
        if int(getattr(layer, "tp_size", 1)) > 1:
            raise QuantLoadError(
                f"{self.prefix}: static W8A8 experts cannot be split over {layer.tp_size} tensor-parallel ranks "
                "(quant_bias folds the input offset over the full expert width); enable expert parallelism "
                "(--enable-expert-parallel) or export the experts as W8A8_DYNAMIC"
            )
        for name in ("w13_weight_scale", "w2_weight_scale", "w13_weight_offset", "w2_weight_offset"):
            del layer._parameters[name]  # deq_scale already holds s_x * s_w; the weights are symmetric
        for w in ("w13", "w2"):
            s_x = getattr(layer, f"{w}_input_scale").data.float().reshape(-1)
            o_x = getattr(layer, f"{w}_input_offset").data.float().reshape(-1)
            deq = kernels.decode_scale(getattr(layer, f"{w}_deq_scale").data)
            require_positive(s_x, f"{self.prefix}.{w}_input_scale")
            if bool((o_x != torch.round(o_x)).any()) or bool((o_x < -128).any()) or bool((o_x > 127).any()):
                raise QuantLoadError(f"{self.prefix}.{w}_input_offset must hold integers in [-128, 127]")
            require_positive(deq, f"{self.prefix}.{w}_deq_scale")
            replace_param(layer, f"{w}_deq_scale", deq.contiguous())  # [E, N] float32
            replace_param(layer, f"{w}_input_inv_scale", (1.0 / s_x).contiguous())  # [E]
            replace_param(layer, f"{w}_input_offset", o_x.contiguous())  # [E]
            del layer._parameters[f"{w}_input_scale"]
        replace_param(layer, "w13_weight", param(layer, "w13_weight").data.transpose(1, 2).contiguous())  # [E, H, 2I]
        replace_param(layer, "w2_weight", param(layer, "w2_weight").data.transpose(1, 2).contiguous())  # [E, I, H]
        self._build(layer)

    def _make_experts(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return W8A8StaticExperts(layer, activation)
