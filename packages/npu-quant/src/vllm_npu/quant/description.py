# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The msModelSlim quant description (``quant_model_description.json``): parsing and tolerant name resolution.

The file is a flat JSON object. Tensor keys map a checkpoint tensor name to a quant type::

    {"model.layers.0.self_attn.q_proj.weight": "W8A8", "model.layers.0.self_attn.q_proj.input_scale": "W8A8",
     "model.layers.0.mlp.down_proj.weight": "FLOAT", "lm_head.weight": "FLOAT", ...,
     "group_size": 256, "version": "1.0.0", "kv_quant_type": "C8", "fa_quant_type": null,
     "model_quant_type": "W8A8"}

Global keys (not tensor names) are listed in :data:`GLOBAL_KEYS`. Old msModelSlim versions put the same mapping
into ``config.json`` as ``quantization_config``; :func:`looks_like_description` recognises both (it, the file name and
:func:`find_description_file` are :mod:`vllm_npu.interface.quant_checkpoint`'s, re-exported here).

Nothing here imports torch or vLLM: the resolution rules are plain string logic, tested on their own.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The file-level detection contract lives in the interface (the platform applies it without this layer).
from vllm_npu.interface import (  # noqa: F401 (re-exported: this layer's names for them)
    DESCRIPTION_FILENAME,
    QUANT_TYPES,
    find_description_file,
    looks_like_description,
)

#: Schemes this package implements for linear layers and for FusedMoE experts.
LINEAR_SCHEMES = ("W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A4_FLATQUANT_DYNAMIC")
MOE_SCHEMES = ("W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC")

#: Keys that are settings, not tensor names.
GLOBAL_KEYS = (
    "group_size",
    "version",
    "kv_quant_type",
    "fa_quant_type",
    "model_quant_type",
    "quant_method",
    "kv_cache_type",
    "reduce_quant_type",
    "metadata",
)

#: The settings that ask for an int8 KV cache: vllm-ascend v0.11.0 reads ``kv_quant_type``
#: (``quantization/quant_config.py:119-121``); msModelSlim / MindIE's "KV Cache int8" docs write ``kv_cache_type``.
KV_CACHE_KEYS = ("kv_quant_type", "kv_cache_type")

DEFAULT_PACKED_MODULES: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


class QuantDescriptionError(ValueError):
    """The description does not cover a layer, or its entries contradict each other. The message names the layer,
    the keys looked up, the nearest keys present and the fix."""


def _variants(prefix: str) -> list[str]:
    """Spellings under which a vLLM module prefix may appear in a msModelSlim description, best first.

    vLLM model classes add or drop wrappers that the HF checkpoint (hence msModelSlim) does not have: multimodal
    models nest the text model under ``language_model.`` (``model.language_model.`` in newer HF layouts), some
    vLLM classes name the decoder ``model.`` where the checkpoint has none, and DeepSeek MTP layers carry a
    ``shared_head.`` that vLLM folds away.
    """
    out: list[str] = []

    def add(p: str) -> None:
        if p and p not in out:
            out.append(p)

    add(prefix)
    stripped = prefix
    for head in ("model.language_model.", "language_model.model.", "language_model."):
        if prefix.startswith(head):
            stripped = prefix[len(head) :]
            add(stripped)
            add("model." + stripped)
            add("language_model.model." + stripped)
            add("model.language_model." + stripped)
    for p in list(out):
        if p.startswith("model."):
            add(p[len("model.") :])
        else:
            add("model." + p)
    if prefix.startswith("model.") and not prefix.startswith("model.language_model."):
        add("model.language_model." + prefix[len("model.") :])
        add("language_model." + prefix)
    return out


@dataclass
class QuantDescription:
    """A parsed description: ``tensors`` (tensor name -> quant type) plus the global settings.

    ``shared_head`` keys are also indexed without the ``shared_head.`` segment (DeepSeek MTP, where vLLM's module
    names omit it).
    """

    tensors: dict[str, str]
    settings: dict[str, Any] = field(default_factory=dict)
    source: str = "<description>"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], source: str = "<description>") -> QuantDescription:
        if not isinstance(raw, Mapping):
            raise QuantDescriptionError(
                f"{source}: a quant description must be a JSON object, got {type(raw).__name__}"
            )
        tensors: dict[str, str] = {}
        settings: dict[str, Any] = {}
        unknown: list[str] = []
        for key, value in raw.items():
            if key in GLOBAL_KEYS:
                settings[key] = value
            elif isinstance(value, str) and value in QUANT_TYPES:
                tensors[key] = value
            elif isinstance(value, str) and "." in key:
                unknown.append(f"{key}={value!r}")
            else:
                settings[key] = value
        if unknown:
            raise QuantDescriptionError(
                f"{source}: unknown quant type(s) {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}; "
                f"known types: {', '.join(QUANT_TYPES)}. This msModelSlim format is not supported by npu-quant."
            )
        if not tensors:
            raise QuantDescriptionError(
                f"{source}: no tensor entries (expected keys like 'model.layers.0.mlp.down_proj.weight': 'W8A8'); "
                "is this a msModelSlim quant_model_description.json?"
            )
        for key, value in list(tensors.items()):
            if ".shared_head." in key:
                tensors.setdefault(key.replace(".shared_head.", "."), value)
        desc = cls(tensors, settings, source)
        desc._validate_settings()
        return desc

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> QuantDescription:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise QuantDescriptionError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_mapping(raw, source=str(path))

    def _validate_settings(self) -> None:
        gs = self.settings.get("group_size", 256)
        if not isinstance(gs, int) or isinstance(gs, bool) or gs < 0:
            raise QuantDescriptionError(f"{self.source}: group_size must be a non-negative integer, got {gs!r}")
        for key in KV_CACHE_KEYS:
            value = self.settings.get(key)
            if value is not None and value != "C8":
                raise QuantDescriptionError(
                    f"{self.source}: {key}={value!r} is unknown; npu-quant serves the int8 KV cache 'C8' (or none: "
                    "null / absent)"
                )
        version = self.settings.get("version", "0")
        if str(version) not in ("0", "1.0.0"):
            raise QuantDescriptionError(
                f"{self.source}: version {version!r} is unknown; npu-quant reads '0' (default) and '1.0.0'"
            )

    # --- settings ------------------------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        return int(self.settings.get("group_size", 256))

    @property
    def version(self) -> str:
        return str(self.settings.get("version", "0"))

    @property
    def kv_quant_type(self) -> str | None:
        return self.settings.get("kv_quant_type")

    @property
    def kv_cache_type(self) -> str | None:
        return self.settings.get("kv_cache_type")

    @property
    def kv_c8(self) -> bool:
        """Whether the checkpoint asks for an int8 KV cache (C8), in either spelling of :data:`KV_CACHE_KEYS`."""
        return any(self.settings.get(k) == "C8" for k in KV_CACHE_KEYS)

    def kv_scale_keys(self) -> list[str]:
        """The description's C8 scale entries (either spelling: ``*.kv_cache_scale`` / ``*_antiquant_scale``)."""
        return [
            k for k in self.tensors if k.endswith((".kv_cache_scale", ".key_antiquant_scale", ".value_antiquant_scale"))
        ]

    @property
    def fa_quant_type(self) -> str | None:
        return self.settings.get("fa_quant_type")

    # --- resolution ------------------------------------------------------------------------------------------------
    def _nearest(self, wanted: Sequence[str], n: int = 3) -> list[str]:
        keys = list(self.tensors)
        near: list[str] = []
        for w in wanted:
            for k in difflib.get_close_matches(w, keys, n=n, cutoff=0.6):
                if k not in near:
                    near.append(k)
        return near[:n]

    def _missing(self, layer: str, looked_up: Sequence[str]) -> QuantDescriptionError:
        near = self._nearest(looked_up[:4])
        hint = f"nearest keys present: {', '.join(near)}" if near else "no similar key is present"
        return QuantDescriptionError(
            f"quant description {self.source} has no entry for layer {layer!r}: looked up "
            f"{', '.join(repr(k) for k in looked_up)}; {hint}. The checkpoint's module names differ from the "
            'model\'s: re-export it with msModelSlim for this model, or add the entries ("FLOAT" for layers kept '
            "in floating point)."
        )

    def lookup_tensor(self, layer: str, names: Iterable[str]) -> tuple[str, str]:
        """The first of ``names`` (each tried in every spelling of :func:`_variants`) found. Returns (key, type)."""
        looked: list[str] = []
        for name in names:
            for variant in _variants(name):
                if variant in self.tensors:
                    return variant, self.tensors[variant]
                if variant not in looked:
                    looked.append(variant)
        raise self._missing(layer, looked)

    def linear_type(self, prefix: str, packed_modules: Mapping[str, Sequence[str]] | None = None) -> str:
        """The quant type of the linear layer at vLLM prefix ``prefix``.

        A packed module (``qkv_proj``, ``gate_up_proj``, or whatever ``packed_modules`` names) is looked up shard by
        shard; every shard must have the same type.
        """
        mapping: dict[str, Sequence[str]] = dict(DEFAULT_PACKED_MODULES)
        mapping.update(packed_modules or {})
        head, _, last = prefix.rpartition(".")
        shards = mapping.get(last)
        if shards and not any(v in self.tensors for v in _variants(f"{prefix}.weight")):
            found: list[tuple[str, str]] = []
            for shard in shards:
                shard_prefix = f"{head}.{shard}" if head else shard
                found.append(self.lookup_tensor(prefix, [f"{shard_prefix}.weight"]))
            types = {t for _, t in found}
            if len(types) != 1:
                detail = ", ".join(f"{k}={t}" for k, t in found)
                raise QuantDescriptionError(
                    f"the shards of packed layer {prefix!r} disagree ({detail}); vLLM fuses them into one matmul, so "
                    "they must share one quant type: re-export with the same scheme for all of them"
                )
            return types.pop()
        return self.lookup_tensor(prefix, [f"{prefix}.weight"])[1]

    def experts_type(self, prefix: str) -> str:
        """The quant type of the FusedMoE layer at ``prefix`` (e.g. ``model.layers.3.mlp.experts``): every expert
        weight under it must share one type."""
        found: dict[str, str] = {}
        for variant in _variants(prefix):
            dotted = variant + "."
            found = {k: t for k, t in self.tensors.items() if k.startswith(dotted) and k.endswith(".weight")}
            if found:
                break
        if not found:
            raise self._missing(prefix, [f"{v}.<expert>.<proj>.weight" for v in _variants(prefix)])
        types = sorted(set(found.values()))
        if len(types) != 1:
            sample = {t: next(k for k, v in found.items() if v == t) for t in types}
            detail = ", ".join(f"{k}={t}" for t, k in sample.items())
            raise QuantDescriptionError(
                f"the experts of FusedMoE layer {prefix!r} mix quant types ({detail}); all experts of one layer run in "
                "one grouped matmul and must share one type"
            )
        return types[0]
