# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""C8: the int8 KV cache of a msModelSlim checkpoint -- the attention layer's per-channel K/V scales.

A checkpoint is C8 when its description says ``kv_quant_type: C8`` (what vllm-ascend v0.11.0 reads,
``quantization/quant_config.py:119-121``) or ``kv_cache_type: C8`` (what msModelSlim / MindIE document for "KV Cache
int8"). The scales come in either of two tensor spellings, per attention layer of ``Nkv`` KV heads of size ``D``:

- vllm-ascend's parameters ``<layer>.attn.key_antiquant_scale`` / ``value_antiquant_scale`` ``[Nkv * D]``
  (``quantization/w8a8.py:357-374``; loaded by the model's own loader under that name);
- msModelSlim's ``<layer>.k_proj.kv_cache_scale`` / ``v_proj.kv_cache_scale`` (and ``kv_cache_offset``) ``[Nkv * D]``
  (MindIE "KV Cache int8": float16 / bfloat16, shape ``[kv_head_num * kv_head_dim]``). vLLM's loaders rename
  ``k_proj`` / ``v_proj`` to the packed ``qkv_proj`` with shard id ``"k"`` / ``"v"``, so this method registers
  ``kv_cache_scale`` / ``kv_cache_offset`` ``[2, Nkv * D]`` holders on that layer (or on ``k_proj`` / ``v_proj`` for
  models that keep them apart) and moves them to the attention layer after loading.

The int8 maths (symmetric, per channel): ``int8 = clamp(round(x / scale), -128, 127)``, ``x' = int8 * scale``. A
non-zero ``kv_cache_offset`` (asymmetric) is refused by name; so are scales that are missing, mis-shaped,
non-finite or not positive.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm_npu.interface import ConfigError

from .description import QuantDescriptionError

#: The attention layer's scale parameters (vllm-ascend's names; npu-attention's GQA backend reads them).
K_SCALE, V_SCALE = "key_antiquant_scale", "value_antiquant_scale"
#: msModelSlim's per-projection tensors.
MS_SCALE, MS_OFFSET = "kv_cache_scale", "kv_cache_offset"
_SHARD_ROW = {"k": 0, "v": 1}


def _tp() -> tuple[int, int]:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):  # no distributed state (unit tests)
        return 0, 1


def _local(loaded: torch.Tensor, local: int, name: str) -> torch.Tensor:
    """This rank's slice of a ``[Nkv_total * D]`` scale (KV heads split over tensor-parallel ranks)."""
    flat = loaded.reshape(-1)
    if flat.numel() == local:
        return flat
    rank, size = _tp()
    if flat.numel() == local * size:
        return flat.narrow(0, rank * local, local)
    raise QuantDescriptionError(
        f"C8 scale {name!r} has shape {tuple(loaded.shape)}; this layer needs [num_kv_heads * head_dim] = "
        f"[{local * size}] per channel (or [{local}] per rank). Re-export the checkpoint with per-channel KV scales"
    )


class AscendC8KVCacheMethod(BaseKVCacheMethod):
    """The quant method of one attention layer of a C8 checkpoint: registers the scale parameters (and the
    msModelSlim holders on the K/V projections), checks and moves them after loading."""

    def __init__(self, quant_config: Any, prefix: str, projections: dict[str, torch.nn.Module]) -> None:
        super().__init__(quant_config)
        self.prefix = prefix
        # "qkv_proj" or "k_proj" / "v_proj" of this attention block (built before it), for msModelSlim's spelling
        self.projections = projections

    def create_weights(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "kv_cache_dtype", None) != "int8":
            raise ConfigError(
                f"C8 checkpoint: attention layer {self.prefix!r} got kv_cache_dtype="
                f"{getattr(layer, 'kv_cache_dtype', None)!r}, not the int8 cache its scales are for (the NPU platform "
                "sets it for C8 checkpoints served with --quantization ascend); a float cache would ignore the scales"
            )
        super().create_weights(layer)  # vLLM's fp8 q/k/v/prob scalars: unused by C8, removed after loading
        n = int(layer.num_kv_heads) * int(layer.head_size)  # type: ignore[arg-type]
        self.width = n
        for name in (K_SCALE, V_SCALE):
            param = torch.nn.Parameter(torch.full((n,), float("nan")), requires_grad=False)
            param.weight_loader = self._direct_loader(name)  # type: ignore[attr-defined]
            layer.register_parameter(name, param)
        packed = self.projections.get("qkv_proj")
        if packed is not None:
            for name in (MS_SCALE, MS_OFFSET):
                param = torch.nn.Parameter(torch.full((2, n), float("nan")), requires_grad=False)
                param.weight_loader = self._packed_loader(name)  # type: ignore[attr-defined]
                packed.register_parameter(name, param)
        for proj in ("k_proj", "v_proj"):
            module = self.projections.get(proj)
            if module is None:
                continue
            for name in (MS_SCALE, MS_OFFSET):
                param = torch.nn.Parameter(torch.full((n,), float("nan")), requires_grad=False)
                param.weight_loader = self._direct_loader(f"{proj}.{name}")  # type: ignore[attr-defined]
                module.register_parameter(name, param)

    def _direct_loader(self, name: str) -> Any:
        def load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            param.data.copy_(_local(loaded, param.numel(), f"{self.prefix}.{name}").float())

        return load

    def _packed_loader(self, name: str) -> Any:
        def load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            row = _SHARD_ROW.get(shard_id) if isinstance(shard_id, str) else None
            if row is None:
                raise QuantDescriptionError(
                    f"{self.prefix}: {name} came for projection shard {shard_id!r}; C8 scales belong to k_proj / "
                    "v_proj only"
                )
            label = f"{self.prefix}.{'kv'[row]}_proj.{name}"
            param.data[row].copy_(_local(loaded, param.shape[1], label).float())

        return load

    def _from_projections(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        packed = self.projections.get("qkv_proj")
        if packed is not None and hasattr(packed, name):
            t = getattr(packed, name).data
            return t[0], t[1]
        k, v = self.projections.get("k_proj"), self.projections.get("v_proj")
        return (
            getattr(k, name).data if k is not None and hasattr(k, name) else None,
            getattr(v, name).data if v is not None and hasattr(v, name) else None,
        )

    def _drop_holders(self) -> None:
        for module in self.projections.values():
            for name in (MS_SCALE, MS_OFFSET):
                if name in module._parameters:
                    del module._parameters[name]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # vLLM's fp8 scalars are not C8's (BaseKVCacheMethod would log an fp8 warning for them): dropped unread.
        for name in ("q_scale", "k_scale", "v_scale", "prob_scale"):
            if name in layer._parameters:
                del layer._parameters[name]
        own = (getattr(layer, K_SCALE).data, getattr(layer, V_SCALE).data)
        ms_k, ms_v = self._from_projections(MS_SCALE)
        off_k, off_v = self._from_projections(MS_OFFSET)
        self._drop_holders()
        scales: dict[str, torch.Tensor] = {}
        for kv, mine, theirs, offset in (("key", own[0], ms_k, off_k), ("value", own[1], ms_v, off_v)):
            proj = f"{kv[0]}_proj"
            if not torch.isnan(mine).all():
                scale, source = mine, f"{self.prefix}.{kv}_antiquant_scale"
            elif theirs is not None and not torch.isnan(theirs).all():
                scale, source = theirs, f"{self.prefix.rpartition('.')[0]}.{proj}.{MS_SCALE}"
            else:
                raise ConfigError(
                    f"C8 checkpoint: attention layer {self.prefix!r} has no {kv} scale (looked for "
                    f"{self.prefix}.{kv}_antiquant_scale and {proj}.{MS_SCALE} beside it). Every attention layer "
                    "of a C8 checkpoint needs per-channel K and V scales: re-export it (all *.safetensors present)"
                )
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                bad = scale[~(torch.isfinite(scale) & (scale > 0))]
                raise ConfigError(
                    f"C8 checkpoint: {source} has {bad.numel()} non-positive or non-finite value(s) (e.g. "
                    f"{float(bad[0])}); an int8 KV scale must be > 0 in every channel: re-calibrate the checkpoint"
                )
            if offset is not None and not torch.isnan(offset).all() and bool((offset != 0).any()):
                raise ConfigError(
                    f"C8 checkpoint: {self.prefix.rpartition('.')[0]}.{proj}.{MS_OFFSET} is not zero (asymmetric "
                    "int8 KV); npu-quant serves symmetric C8 only: re-export with a symmetric KV-cache quantization"
                )
            scales[kv] = scale.float().contiguous()
        for name, kv in ((K_SCALE, "key"), (V_SCALE, "value")):
            del layer._parameters[name]
            layer.register_buffer(name, scales[kv], persistent=False)


def c8_projections(linears: dict[str, torch.nn.Module], prefix: str) -> dict[str, torch.nn.Module]:
    """The K/V projection layers of attention layer ``prefix`` (``<block>.attn`` -> ``<block>.qkv_proj`` or
    ``<block>.k_proj`` / ``<block>.v_proj``), among the linear layers built so far."""
    block = prefix.rpartition(".")[0]
    found = {}
    for proj in ("qkv_proj", "k_proj", "v_proj"):
        key = f"{block}.{proj}" if block else proj
        if key in linears:
            found[proj] = linears[key]
    return found


def check_c8_layer(layer: torch.nn.Module, prefix: str, source: str) -> None:
    """Refuse, by name and before loading, an attention layer of a C8 checkpoint the int8 cache cannot serve."""
    if getattr(layer, "use_mla", False) or getattr(layer, "use_sparse", False):
        raise ConfigError(
            f"{source} asks for an int8 KV cache (C8), and {prefix!r} is an MLA attention layer (DeepSeek-style "
            "latent cache): C8 serves GQA/MHA layers only here (msModelSlim documents KV Cache int8 for GQA models; "
            "MLA's int8 path is its FA3 quantization, fa_quant_type, not supported). Re-export without KV-cache "
            "quantization"
        )
