# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""HF checkpoint -> msModelSlim-format checkpoint (safetensors + quant_model_description.json), without msModelSlim.

What gets quantized: every ``nn.Linear`` inside the decoder layers with the chosen scheme, except MoE routers
(``*.gate``, ``*shared_expert_gate``, ``*router*``), which stay FLOAT. MoE experts (``*.experts.<e>.*``) use
W4A8_DYNAMIC with ``--scheme W4A8_DYNAMIC`` (format version 0 or 1.0.0, as the dense layers), static W8A8 with ``--scheme W8A8`` (per-expert
input ranges from the calibration; an expert no calibration token was routed to takes the union of its layer's
calibrated experts' ranges for the same projection) and W8A8_DYNAMIC otherwise.
Embeddings, norms and ``lm_head`` stay FLOAT. W8A8 (static) calibrates per-tensor input ranges by running the HF
model on calibration prompts.

Multi-token-prediction layers (DeepSeek-V3 ``num_nextn_predict_layers``: ``model.layers.<n>.*`` past the decoder
layers, which HF transformers does not load) are copied from the source safetensors: with a dynamic scheme
(W8A8_DYNAMIC, W4A8_DYNAMIC) their decoder-block linears (the same names as the decoder layers' quantized ones)
are quantized like the decoder layers' and everything else (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.{norm,head}``, ``embed_tokens``, norms, the router) stays FLOAT; with a static scheme (W8A8,
W4A4_FLATQUANT) the MTP layers stay FLOAT, since the HF forward that calibrates never runs them.

The output directory gets: ``quant_model_weights.safetensors``, ``quant_model_description.json``, ``config.json``
(the input's, plus ``"quantization_config": {"quant_method": "ascend"}`` so vLLM selects the method by itself),
``generation_config.json`` and tokenizer files copied.

The input is only read. Before any weight is read, outputs that would touch the input (the input itself, inside it,
containing it) or a user's non-empty directory (unless ``overwrite``) are refused, and so is an input that is already
quantized (:mod:`.quantize_paths`). Everything is written into a private sibling of the output directory that is
renamed into place at the end, so an error or Ctrl-C leaves no half-written output
(:func:`vllm_npu.interface.staging.staged_directory`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm_npu.interface import staged_directory

from ..description import DESCRIPTION_FILENAME, MOE_SCHEMES
from ..schemes.w4a4_flatquant import decompose_dim
from .quantize_kv import KV_CACHE_SCHEMES, c8_tensors, calibrate_kv
from .quantize_math import (
    flatquant_transforms,
    quantize_w4a4_flatquant,
    quantize_w4a8,
    quantize_w8a8,
    quantize_w8a8_dynamic,
)
from .quantize_paths import QuantizeError, checked_output, read_config, refuse_quantized_input

SCHEMES = {
    "W8A8": "W8A8",
    "W8A8_DYNAMIC": "W8A8_DYNAMIC",
    "W4A8_DYNAMIC": "W4A8_DYNAMIC",
    "W4A4_FLATQUANT": "W4A4_FLATQUANT_DYNAMIC",
    "W4A4_FLATQUANT_DYNAMIC": "W4A4_FLATQUANT_DYNAMIC",
}
MOE_SCHEME = "W8A8_DYNAMIC"
WEIGHTS_FILE = "quant_model_weights.safetensors"

DEFAULT_CALIBRATION = [
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
    "Call me Ishmael. Some years ago, never mind how long precisely.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
    "we had everything before us, we had nothing before us",
]
_COPY_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
_ROUTER = re.compile(r"(\.gate|shared_expert_gate|router)$")
_EXPERT = re.compile(r"\.experts\.\d+\.")
_ROW_PARALLEL = re.compile(r"(o_proj|down_proj|dense|out_proj|w2)$")


_LAYER = re.compile(r"^.*?\.layers\.\d+\.")


def _mtp_tensors(model_dir: Path, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The source checkpoint's multi-token-prediction layers: every tensor under ``model.layers.<i>.`` for
    ``num_hidden_layers <= i < num_hidden_layers + num_nextn_predict_layers`` (empty without such layers)."""
    from safetensors import safe_open

    n, extra = int(config.get("num_hidden_layers") or 0), int(config.get("num_nextn_predict_layers") or 0)
    if not extra:
        return {}
    prefixes = tuple(f"model.layers.{i}." for i in range(n, n + extra))
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key.startswith(prefixes):
                    out[key] = f.get_tensor(key)
    if not out:
        raise QuantizeError(
            f"config.json says num_nextn_predict_layers={extra} but {model_dir} has no tensor under "
            f"{', '.join(prefixes)}; fix the config or add the MTP weights"
        )
    return out


def _targets(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {
        name: mod
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}" and not _ROUTER.search(name)
    }


def _pick_group_size(ks: Sequence[int], requested: int | None) -> int:
    if requested is not None:
        bad = sorted({k for k in ks if requested and k % requested})
        if bad:
            raise QuantizeError(f"group size {requested} does not divide input sizes {bad}; choose one that does")
        return requested
    for g in (256, 128, 64, 32):
        if all(k % g == 0 for k in ks):
            return g
    raise QuantizeError(f"no group size in (256, 128, 64, 32) divides all input sizes {sorted(set(ks))}")


@torch.no_grad()
def _calibrate(
    model: torch.nn.Module, tokenizer: Any, names: Sequence[str], prompts: Sequence[str], optional: Sequence[str] = ()
) -> dict[str, tuple[float, float]]:
    stats: dict[str, list[float]] = {}
    handles = []
    modules = dict(model.named_modules())
    for name in [*names, *optional]:

        def hook(mod: torch.nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
            x = args[0].detach().float()
            if not x.numel():  # an expert called with no routed rows
                return
            lo, hi = float(x.min()), float(x.max())
            cur = stats.get(name)
            stats[name] = [min(lo, cur[0]), max(hi, cur[1])] if cur else [lo, hi]

        handles.append(modules[name].register_forward_pre_hook(hook))
    try:
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            model(ids)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in stats]
    if missing:
        raise QuantizeError(f"calibration never reached {missing[:3]}; are they used by the model's forward?")
    return {n: (v[0], v[1]) for n, v in stats.items()}


def _expert_ranges(names: Sequence[str], stats: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Static input ranges for every expert linear: gate_proj and up_proj of one expert share one (the union; the
    MoE kernel quantizes their common input once); an expert no calibration token reached takes the union of the
    same projection over its layer's calibrated experts."""

    def union(rs: Sequence[tuple[float, float]]) -> tuple[float, float]:
        return min(r[0] for r in rs), max(r[1] for r in rs)

    layer_of = {n: _EXPERT.sub(".experts.*.", n) for n in names}
    per_layer: dict[str, list[tuple[float, float]]] = {}
    for n in names:
        if n in stats:
            per_layer.setdefault(layer_of[n], []).append(stats[n])
    out: dict[str, tuple[float, float]] = {}
    for n in names:
        if n in stats:
            out[n] = stats[n]
        elif layer_of[n] in per_layer:
            out[n] = union(per_layer[layer_of[n]])
        else:
            raise QuantizeError(f"calibration reached no expert of {layer_of[n]!r}; give more calibration prompts")
    for n in names:
        if n.endswith("gate_proj"):
            up = n[: -len("gate_proj")] + "up_proj"
            if up in out:
                out[n] = out[up] = union([out[n], out[up]])
    return out


def _scheme_type(scheme: str, w4a8_version: str, group_size: int | None) -> str:
    """The description's ``model_quant_type`` of ``scheme``, after checking the arguments that need no model."""
    if scheme not in SCHEMES:
        raise QuantizeError(
            f"unknown scheme {scheme!r}; choose one of {', '.join(sorted(set(SCHEMES) - {'W4A4_FLATQUANT_DYNAMIC'}))}"
        )
    if w4a8_version not in ("0", "1.0.0"):
        raise QuantizeError(f"W4A8 format version must be '0' or '1.0.0', got {w4a8_version!r}")
    if group_size is not None and group_size <= 0:
        raise QuantizeError(f"group size must be a positive integer, got {group_size}")
    return SCHEMES[scheme]


def _load_model(model_dir: Path, config: dict[str, Any]) -> tuple[torch.nn.Module, torch.dtype]:
    """The HF causal LM of ``model_dir`` in its checkpoint dtype (``torch_dtype`` / ``dtype`` of config.json), in eval
    mode."""
    from transformers import AutoModelForCausalLM

    dtype_name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise QuantizeError(f"{model_dir}/config.json: torch_dtype {dtype_name!r} is not a floating-point torch dtype")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:  # no weights, not a causal LM, an architecture it does not know
        raise QuantizeError(f"transformers cannot load {model_dir} as a causal LM: {exc}") from exc
    model.eval()
    return model, dtype


def _scheme_settings(
    qtype: str,
    targets: dict[str, torch.nn.Linear],
    dense: dict[str, torch.nn.Linear],
    group_size: int | None,
    w4a8_version: str,
    clip_ratio: float,
) -> dict[str, Any]:
    """The description's global settings (``model_quant_type``, ``version``, W4A8's ``group_size``), after checking
    that the scheme fits every target linear's shape."""
    settings: dict[str, Any] = {"model_quant_type": qtype, "version": "0"}
    if qtype == "W4A8_DYNAMIC":
        settings["group_size"] = _pick_group_size([m.in_features for m in targets.values()], group_size)
        settings["version"] = w4a8_version
        bad = sorted({n for n, m in targets.items() if m.out_features % 8})
        if bad:
            raise QuantizeError(f"W4A8_DYNAMIC needs output sizes divisible by 8; {bad[:3]} are not")
    if qtype == "W4A4_FLATQUANT_DYNAMIC":
        for n, m in dense.items():
            nl, nr = decompose_dim(m.in_features)
            if m.in_features % 8 or nr % 8:
                raise QuantizeError(
                    f"{n}: input size {m.in_features} = {nl} x {nr}; W4A4_FLATQUANT needs K and R divisible by 8"
                )
        if not 0 < clip_ratio <= 1:
            raise QuantizeError(f"clip ratio must lie in (0, 1], got {clip_ratio}")
    return settings


@dataclass
class _Output:
    """The checkpoint being built: tensors by name and the description's type of each (``FLOAT`` until a linear
    is quantized), and how each linear is quantized (scheme arguments, W8A8's calibrated input ranges, W4A4's
    transforms, one per input size: shards sharing an input agree by construction)."""

    state: dict[str, torch.Tensor]
    dtype: torch.dtype
    settings: dict[str, Any]
    ranges: dict[str, tuple[float, float]]
    w4a8_version: str
    clip_ratio: float
    seed: int
    description: dict[str, Any] = field(default_factory=dict)
    transforms: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.description = {k: "FLOAT" for k in self.state}

    def quantize(self, name: str, mod: torch.nn.Linear, t: str, bias: torch.Tensor | None) -> None:
        """Replace ``<name>.weight`` with the quantized tensors of scheme ``t`` (``bias`` folded in by W8A8)."""
        w = mod.weight.detach()
        tensors: dict[str, torch.Tensor]
        if t == "W8A8":
            tensors = quantize_w8a8(w, bias, *self.ranges[name], self.dtype)
        elif t == "W8A8_DYNAMIC":
            tensors = quantize_w8a8_dynamic(w, self.dtype)
        elif t == "W4A8_DYNAMIC":
            row_parallel = bool(_ROW_PARALLEL.search(name))
            tensors = quantize_w4a8(w, self.settings["group_size"], self.w4a8_version, row_parallel, self.dtype)
        else:
            k = mod.in_features
            if k not in self.transforms:
                self.transforms[k] = flatquant_transforms(k, self.seed)
            tensors = quantize_w4a4_flatquant(w, *self.transforms[k], self.clip_ratio, self.dtype)
        del self.state[f"{name}.weight"]
        for suffix, tensor in tensors.items():
            self.state[f"{name}.{suffix}"] = tensor.contiguous()
            self.description[f"{name}.{suffix}"] = t
        if f"{name}.bias" in self.state:
            self.description[f"{name}.bias"] = "FLOAT"

    def add_mtp(
        self, mtp: dict[str, torch.Tensor], targets: dict[str, torch.nn.Linear], qtype: str, expert_type: str
    ) -> None:
        """Copy the MTP layers (floating-point tensors in the checkpoint dtype); with a dynamic scheme, quantize their
        decoder-block linears (those named like a quantized decoder-layer linear) as the decoder layers' are."""
        for key, tensor in mtp.items():
            self.state[key] = tensor.to(self.dtype) if tensor.is_floating_point() else tensor
            self.description[key] = "FLOAT"
        if qtype not in ("W8A8_DYNAMIC", "W4A8_DYNAMIC"):
            return
        suffixes = {_LAYER.sub("", n) for n in targets}
        for key in [k for k in mtp if k.endswith(".weight")]:
            lin = key[: -len(".weight")]
            if _LAYER.sub("", lin) not in suffixes or self.state[key].dim() != 2:
                continue
            t = expert_type if _EXPERT.search(lin) else qtype
            linear = torch.nn.Linear(self.state[key].shape[1], self.state[key].shape[0], bias=False, dtype=self.dtype)
            linear.weight.data.copy_(self.state[key])
            bias = self.state.get(f"{lin}.bias")
            self.quantize(lin, linear, t, bias if t != expert_type else None)


def quantize_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    scheme: str,
    *,
    group_size: int | None = None,
    w4a8_version: str = "0",
    clip_ratio: float = 1.0,
    calibration: Sequence[str] | None = None,
    seed: int = 0,
    overwrite: bool = False,
    kv_cache: str | None = None,
) -> Path:
    """Write a msModelSlim-format checkpoint of the HF model in ``model_dir`` to ``out_dir``. Returns ``out_dir``.

    ``overwrite`` allows replacing a non-empty ``out_dir`` (never the input, nor a directory inside or around it).
    Steps: check the arguments and the paths, load the model, check the scheme against its linears, calibrate
    (W8A8), quantize the decoder layers' linears and experts, add the MTP layers, write through a staging directory.
    ``kv_cache="C8"`` adds an int8 KV cache: per-channel K/V scales calibrated on ``calibration`` (any scheme;
    :mod:`.quantize_kv`).
    """
    qtype = _scheme_type(scheme, w4a8_version, group_size)
    if kv_cache is not None and kv_cache not in KV_CACHE_SCHEMES:
        raise QuantizeError(f"unknown KV-cache scheme {kv_cache!r}; choose {', '.join(KV_CACHE_SCHEMES)} or none")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = read_config(model_dir)
    refuse_quantized_input(model_dir, config)
    final = checked_output(model_dir, out_dir, overwrite=overwrite)
    model, dtype = _load_model(model_dir, config)
    targets = _targets(model)
    if not targets:
        raise QuantizeError(f"no linear layer under '.layers.' in {model_dir}: not a decoder model npu-quant knows")
    dense = {n: m for n, m in targets.items() if not _EXPERT.search(n)}
    experts = {n: m for n, m in targets.items() if _EXPERT.search(n)}
    settings = _scheme_settings(qtype, targets, dense, group_size, w4a8_version, clip_ratio)
    ranges: dict[str, tuple[float, float]] = {}
    kv_scales: dict[str, torch.Tensor] = {}
    if qtype == "W8A8" or kv_cache is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = list(calibration or DEFAULT_CALIBRATION)
        if qtype == "W8A8":
            ranges = _calibrate(model, tok, list(dense), prompts, optional=list(experts))
            ranges.update(_expert_ranges(list(experts), ranges))
        if kv_cache is not None:
            kv_scales = calibrate_kv(model, tok, prompts)

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings") and "lm_head.weight" in state:
        del state["lm_head.weight"]
    out = _Output(state, dtype, settings, ranges, w4a8_version, clip_ratio, seed)
    for name, mod in dense.items():
        out.quantize(name, mod, qtype, mod.bias.detach() if mod.bias is not None else None)
    # experts take the scheme when npu-quant has MoE experts for it, else MOE_SCHEME; no bias is folded in
    expert_type = qtype if qtype in MOE_SCHEMES else MOE_SCHEME
    for name, mod in experts.items():
        out.quantize(name, mod, expert_type, None)
    out.add_mtp(_mtp_tensors(model_dir, config), targets, qtype, expert_type)
    for name, tensor in c8_tensors(kv_scales, dtype).items():
        out.state[name] = tensor
        out.description[name] = qtype  # msModelSlim types the KV tensors like the model's linears
    out.description.update(settings)
    if kv_cache is not None:
        out.description["kv_cache_type"] = kv_cache

    config["quantization_config"] = {"quant_method": "ascend"}
    try:
        with staged_directory(final, replace=overwrite) as staging:
            _write_checkpoint(staging, model_dir, out.state, out.description, config)
    except FileExistsError as exc:  # another process created the output meanwhile
        raise QuantizeError(f"{exc}; choose a new output directory or pass --overwrite") from None
    except OSError as exc:  # no permission, disk full...: nothing was left at the output
        raise QuantizeError(f"cannot write {out_dir}: {exc}; the output was left as it was") from exc
    return out_dir


def _write_checkpoint(
    out: Path, model_dir: Path, state: dict[str, torch.Tensor], description: dict[str, Any], config: dict[str, Any]
) -> None:
    """The output files, written into ``out`` (the staging directory); the input is only read."""
    from safetensors.torch import save_file

    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / DESCRIPTION_FILENAME).write_text(json.dumps(description, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for fname in _COPY_FILES:
        if (model_dir / fname).exists():
            shutil.copy2(model_dir / fname, out / fname)
