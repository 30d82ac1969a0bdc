# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Declared checkpoint tensors of a quantized layer: creation, load-time validation, completeness check.

A scheme lists its tensors as :class:`TensorSpec` s. :func:`create_params` registers one parameter per spec and wraps
vLLM's weight loader so that every tensor read from the checkpoint is checked before it is copied:

- its dtype must be one the spec accepts (vLLM's ``copy_`` would silently cast a float weight into an int8
  parameter);
- a shape that does not fit raises an error naming the tensor and both shapes (vLLM's loaders only ``assert``);
- tensors shared by the shards of a packed layer (per-tensor activation scales, FlatQuant transforms) must agree,
  because the fused layer quantizes its input once;
- every load is recorded, so :func:`check_complete` can name the tensors the checkpoint did not provide (vLLM's
  loader checks completeness only for unquantized models).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class QuantLoadError(ValueError):
    """A checkpoint tensor of a quantized layer is missing or does not fit its declaration."""


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor of a quantized layer, as registered on the vLLM layer (before load-time processing).

    ``accept``: dtypes allowed on disk (converted to ``dtype``; ``convert`` overrides the plain cast).
    ``shared``: one value for the whole layer; the shards of a packed layer must agree on it.
    ``integral``: values must be integers (zero points stored as floats).
    ``required``: False for tensors the forward does not use (they are still validated when present).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    accept: tuple[torch.dtype, ...] = ()
    output_dim: int | None = None
    input_dim: int | None = None
    packed_dim: int | None = None
    packed_factor: int | None = None
    shared: bool = False
    integral: bool = False
    required: bool = True
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    def accepted(self) -> tuple[torch.dtype, ...]:
        return self.accept or (self.dtype,)


def _fmt(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _state(layer: torch.nn.Module) -> dict[str, Any]:
    state = layer.__dict__.get("_npu_quant_state")
    if state is None:
        state = {"loaded": {}, "shared": {}, "specs": {}}
        layer.__dict__["_npu_quant_state"] = state
    return state


def _wrap_loader(
    layer: torch.nn.Module, spec: TensorSpec, prefix: str, inner: Callable[..., Any]
) -> Callable[..., Any]:
    full = f"{prefix}.{spec.name}" if prefix else spec.name

    def load(param: torch.nn.Parameter, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if loaded.dtype not in spec.accepted():
            raise QuantLoadError(
                f"checkpoint tensor {full!r} has dtype {_fmt([loaded.dtype])}, expected {_fmt(spec.accepted())}; "
                "the checkpoint does not match its quant_model_description.json (wrong scheme, or a float tensor "
                "where a quantized one belongs): re-export it"
            )
        if spec.integral and loaded.is_floating_point() and not torch.equal(loaded, torch.round(loaded)):
            raise QuantLoadError(f"checkpoint tensor {full!r} must hold integers (a zero point), got fractional values")
        shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
        expected = _expected_checkpoint_shape(layer, spec, param, shard)
        scalar_ok = loaded.dim() == 0 and expected is not None and math.prod(expected) == 1  # vLLM reshapes a 0-d value
        if expected is not None and tuple(loaded.shape) != expected and not scalar_ok:
            raise QuantLoadError(
                f"checkpoint tensor {full!r}{_shard_text(shard)} has shape {tuple(loaded.shape)}, expected "
                f"{expected}{' (the whole tensor of that shard, before tensor-parallel slicing)' if shard is not None else ''}; "
                "check hidden sizes, head counts, group_size and the checkpoint's scheme"
            )
        converted = spec.convert(loaded) if spec.convert is not None else loaded.to(spec.dtype)
        state = _state(layer)
        if spec.shared:
            seen = state["shared"].setdefault(spec.name, {})
            for other_shard, other in seen.items():
                if other.shape != converted.shape or not torch.allclose(
                    other.float(), converted.float(), rtol=1e-5, atol=1e-7
                ):
                    raise QuantLoadError(
                        f"{full!r}: shard {shard!r} has a different value than shard {other_shard!r} "
                        f"({converted.flatten()[:4].tolist()} vs {other.flatten()[:4].tolist()}); the shards of a fused "
                        "layer share their input, so this per-tensor value must be identical: re-export the checkpoint "
                        "with one activation scale for all of them"
                    )
            seen[shard] = converted.detach().clone()
        try:
            result = inner(param, converted, *args, **kwargs)
        except (AssertionError, RuntimeError, IndexError) as exc:  # vLLM's loaders assert, narrow and index
            raise QuantLoadError(
                f"checkpoint tensor {full!r} (shard {shard!r}) has shape {tuple(loaded.shape)}, which does not fit the "
                f"layer's parameter of shape {tuple(param.shape)} (per rank, expected {tuple(spec.shape)} for the "
                f"whole layer on this rank); check hidden sizes, group_size and the checkpoint's scheme ({exc})"
            ) from None
        state["loaded"].setdefault(spec.name, set()).add(shard)
        return result

    return load


def _shard_text(shard: object) -> str:
    return f" (shard {shard!r} of the fused layer)" if shard is not None else ""


def _shard_output_size(layer: torch.nn.Module, shard: object) -> int | None:
    """The checkpoint's output size of ``shard`` of a fused layer (whole, before tensor-parallel slicing), or None
    for a layer or shard id this does not know: q/k/v of vLLM's ``QKVParallelLinear``, an index into
    ``output_sizes`` of ``MergedColumnParallelLinear`` (gate/up)."""
    if isinstance(shard, str) and hasattr(layer, "total_num_kv_heads"):
        q, kv = getattr(layer, "total_num_heads"), getattr(layer, "total_num_kv_heads")  # noqa: B009 (ints, not tensors)
        heads = {"q": q, "k": kv, "v": kv}
        return int(heads[shard]) * int(getattr(layer, "head_size")) if shard in heads else None  # noqa: B009
    sizes = getattr(layer, "output_sizes", None)
    if isinstance(shard, int) and isinstance(sizes, (list, tuple)) and 0 <= shard < len(sizes):
        return int(sizes[shard])
    return None


def _expected_checkpoint_shape(
    layer: torch.nn.Module, spec: TensorSpec, param: torch.nn.Parameter, shard: object
) -> tuple[int, ...] | None:
    """The shape the checkpoint tensor must have, where it is known before vLLM's loader runs, else None.

    - a per-tensor value (no output or input dim) of any layer: the declared shape (vLLM would copy or broadcast
      whatever it gets, or fail in ``copy_`` without naming the tensor);
    - one shard of a fused layer (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``): the parameter's shape
      with its output dim replaced by that shard's whole output size (divided by the packing factor when packed
      along it). vLLM's merged loaders narrow both tensors by the shard's size and fail with a bare
      ``RuntimeError: start (0) + length (64) exceeds dimension size (32)`` (or copy a wrong slice) otherwise.
      The input dim of a column-parallel layer is not sliced, so it must equal the parameter's.

    Other tensors (unfused layers) are left to vLLM's loader, whose failures are translated below."""
    if spec.output_dim is None and spec.input_dim is None:
        return tuple(param.shape)
    if shard is None or spec.output_dim is None:
        return None
    size = _shard_output_size(layer, shard)
    if size is None:
        return None
    if spec.packed_dim == spec.output_dim and spec.packed_factor:
        size //= spec.packed_factor
    shape = list(param.shape)
    shape[spec.output_dim] = size
    return tuple(shape)


def create_params(
    layer: torch.nn.Module,
    specs: Sequence[TensorSpec],
    weight_loader: Callable[..., Any] | None,
    prefix: str,
    extra_attrs: dict[str, Any] | None = None,
) -> None:
    """Register one parameter per spec on ``layer``, with a validating, recording weight loader."""
    from vllm.model_executor.utils import set_weight_attrs

    state = _state(layer)
    for spec in specs:
        param = torch.nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype), requires_grad=False)
        attrs: dict[str, Any] = {}
        if spec.output_dim is not None:
            attrs["output_dim"] = spec.output_dim
        if spec.input_dim is not None:
            attrs["input_dim"] = spec.input_dim
        if spec.packed_dim is not None:
            attrs["packed_dim"] = spec.packed_dim
            attrs["packed_factor"] = spec.packed_factor
        if spec.output_dim is None:
            attrs["ignore_warning"] = True  # per-tensor values: vLLM copies them to every shard, we check agreement
        attrs.update(spec.attrs)
        attrs.update({k: v for k, v in (extra_attrs or {}).items() if k != "weight_loader"})
        if weight_loader is not None:
            attrs["weight_loader"] = _wrap_loader(layer, spec, prefix, weight_loader)
        layer.register_parameter(spec.name, param)
        set_weight_attrs(param, attrs)
        state["specs"][spec.name] = spec


def check_complete(layer: torch.nn.Module, prefix: str, num_shards: int) -> None:
    """Raise :class:`QuantLoadError` naming every required tensor the checkpoint did not provide (for every shard)."""
    state = _state(layer)
    missing: list[str] = []
    for name, spec in state["specs"].items():
        if not spec.required:
            continue
        shards = state["loaded"].get(name, set())
        if None in shards:
            continue
        if len(shards) < num_shards:
            detail = f" (loaded shards: {sorted(map(str, shards))} of {num_shards})" if shards else ""
            missing.append(f"{prefix}.{name}{detail}")
    if missing:
        raise QuantLoadError(
            f"the checkpoint does not provide {len(missing)} tensor(s) that quant_model_description.json promises: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; re-export the checkpoint (all "
            "*.safetensors files must be present)"
        )


def param(layer: torch.nn.Module, name: str) -> torch.Tensor:
    """``layer.<name>``, a tensor this scheme registered (typed: ``nn.Module.__getattr__`` says tensor or module)."""
    value = getattr(layer, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(layer).__name__}.{name} is a {type(value).__name__}, expected a tensor")
    return value


def loaded_names(layer: torch.nn.Module) -> set[str]:
    return set(_state(layer)["loaded"])


def replace_param(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Swap a parameter for a processed tensor (new shape/dtype), keeping it a frozen Parameter."""
    drop_param(layer, name)
    layer.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))


def drop_param(layer: torch.nn.Module, name: str) -> None:
    """Remove parameter ``name`` from ``layer`` if it is there (tensors the forward no longer reads)."""
    if name in layer._parameters:
        del layer._parameters[name]
