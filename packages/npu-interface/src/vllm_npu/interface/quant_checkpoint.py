# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The file-level contract of a msModelSlim checkpoint: how any layer tells one apart, without the quant layer.

A checkpoint is msModelSlim-quantized (served by the ``ascend`` quant method of npu-quant) when either

- its directory holds ``quant_model_description.json`` (new msModelSlim exports, which drop ``quantization_config``
  from ``config.json``), or
- ``config.json``'s ``quantization_config`` says ``"quant_method": "ascend"`` (what ``vllm-npu quantize`` writes), or
  is itself a description (old msModelSlim: at least one ``<tensor>.weight`` key with a known quant type).

npu-quant claims such checkpoints by these rules, and the platform refuses them by the same rules when npu-quant is
absent. Nothing here imports torch or vLLM; only :func:`read_scheme` reads a file (the JSON description).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The description file msModelSlim writes beside ``config.json``.
DESCRIPTION_FILENAME = "quant_model_description.json"
#: The vLLM quantization method name of these checkpoints.
QUANT_METHOD = "ascend"
#: Quant types of tensor keys, as written by msModelSlim.
QUANT_TYPES = ("W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A4_FLATQUANT_DYNAMIC", "FLOAT", "C8")


def looks_like_description(cfg: Mapping[str, Any] | None) -> bool:
    """Whether ``cfg`` (a parsed JSON object) is a msModelSlim description: at least one ``<tensor>.weight`` key
    with a known quant type. FP8, AWQ, GPTQ, compressed-tensors configs never match."""
    if not isinstance(cfg, Mapping):
        return False
    return any(
        isinstance(k, str) and k.endswith(".weight") and isinstance(v, str) and v in QUANT_TYPES for k, v in cfg.items()
    )


def is_msmodelslim_quant_config(hf_quant_cfg: Any) -> bool:
    """Whether ``config.json``'s ``quantization_config`` (a dict, or None) marks a msModelSlim checkpoint:
    ``quant_method`` is ``ascend``, or the dict is a description itself."""
    if not isinstance(hf_quant_cfg, Mapping):
        return False
    return hf_quant_cfg.get("quant_method") == QUANT_METHOD or looks_like_description(hf_quant_cfg)


def find_description_file(model_dir: str | os.PathLike[str] | None) -> Path | None:
    """``<model_dir>/quant_model_description.json`` if it exists (local directories only: one ``stat``), else None."""
    if not model_dir:
        return None
    path = Path(model_dir) / DESCRIPTION_FILENAME
    return path if path.is_file() else None


def scheme_of(cfg: Mapping[str, Any]) -> str | None:
    """The scheme a description declares: its ``model_quant_type``, else the sorted non-float tensor types
    (``"W8A8, W8A8_DYNAMIC"``), else None."""
    declared = cfg.get("model_quant_type")
    if isinstance(declared, str) and declared:
        return declared
    types = sorted(
        {
            v
            for k, v in cfg.items()
            if isinstance(k, str) and k.endswith(".weight") and v in QUANT_TYPES and v != "FLOAT"
        }
    )
    return ", ".join(types) or None


def read_scheme(model_dir: str | os.PathLike[str] | None, hf_quant_cfg: Any = None) -> str:
    """A human-readable name of the scheme of a msModelSlim checkpoint, for messages: from ``hf_quant_cfg`` when
    it is a description, else from the description file, else ``quant_method 'ascend'``. Never raises."""
    if isinstance(hf_quant_cfg, Mapping) and looks_like_description(hf_quant_cfg):
        return scheme_of(hf_quant_cfg) or "unnamed"
    path = find_description_file(model_dir)
    if path is not None:
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return f"unreadable {DESCRIPTION_FILENAME} ({type(exc).__name__})"
        if isinstance(cfg, Mapping):
            return scheme_of(cfg) or "unnamed"
    return f"quant_method {QUANT_METHOD!r}"


def _read_description(model_dir: str | os.PathLike[str] | None, hf_quant_cfg: Any) -> Mapping[str, Any] | None:
    """The description: ``hf_quant_cfg`` when it is one, else the description file's; None when unreadable."""
    cfg: Any = hf_quant_cfg if looks_like_description(hf_quant_cfg) else None
    path = None if cfg is not None else find_description_file(model_dir)
    if path is not None:
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    return cfg if isinstance(cfg, Mapping) else None


def quant_types(model_dir: str | os.PathLike[str] | None, hf_quant_cfg: Any = None) -> frozenset[str] | None:
    """The quant types a msModelSlim checkpoint uses: its tensors' non-float types (``W8A8_DYNAMIC``, ...) plus its
    ``kv_quant_type`` / ``kv_cache_type`` / ``fa_quant_type`` settings (``C8``), from ``hf_quant_cfg`` when it is a description, else
    from the description file; None when there is no readable description. Never raises."""
    cfg = _read_description(model_dir, hf_quant_cfg)
    if cfg is None:
        return None
    types = {v for k, v in cfg.items() if isinstance(k, str) and k.endswith(".weight") and v in QUANT_TYPES}
    types |= {
        cfg[k] for k in ("kv_quant_type", "kv_cache_type", "fa_quant_type") if isinstance(cfg.get(k), str) and cfg[k]
    }
    return frozenset(types - {"FLOAT"})


#: A routed expert's weight key: ``<...>.experts.<expert>.<proj>.weight`` (vLLM FusedMoE layers are named
#: ``<...>.experts``; ``shared_experts`` are dense layers and do not match).
_EXPERT_WEIGHT = re.compile(r"(^|\.)experts\.\d+\.[^.]+\.weight$")


def expert_quant_types(model_dir: str | os.PathLike[str] | None, hf_quant_cfg: Any = None) -> frozenset[str] | None:
    """The non-float quant types of a msModelSlim checkpoint's routed MoE experts (keys
    ``<...>.experts.<e>.<proj>.weight``), read as :func:`quant_types` reads; None without a readable description."""
    cfg = _read_description(model_dir, hf_quant_cfg)
    if cfg is None:
        return None
    types = {v for k, v in cfg.items() if isinstance(k, str) and _EXPERT_WEIGHT.search(k) and v in QUANT_TYPES}
    return frozenset(types - {"FLOAT"})
