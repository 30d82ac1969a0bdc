# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""What ``vllm-npu quantize`` refuses before it reads a weight: outputs that would damage the input or overwrite a
user's directory, and inputs that are not float checkpoints. Imports neither torch nor transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_npu.interface import is_empty_dir

from ..description import DESCRIPTION_FILENAME


class QuantizeError(ValueError):
    """The model cannot be quantized with the requested scheme (the message says why and what to change)."""


def read_config(model_dir: Path) -> dict[str, Any]:
    """The input's ``config.json``, or a :class:`QuantizeError` that says what is wrong with the directory."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise QuantizeError(f"{model_dir} has no config.json; pass a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantizeError(f"{config_path} is not valid JSON ({exc}); pass a Hugging Face checkpoint") from None
    if not isinstance(config, dict):
        raise QuantizeError(f"{config_path} holds no JSON object; pass a Hugging Face checkpoint")
    return config


def refuse_quantized_input(model_dir: Path, config: dict[str, Any]) -> None:
    """Refuse a checkpoint that is already quantized (ours, msModelSlim's or any other method's)."""
    fix = "pass the float (unquantized) checkpoint it was made from"
    if (model_dir / DESCRIPTION_FILENAME).is_file():
        raise QuantizeError(f"{model_dir} is already quantized (it has {DESCRIPTION_FILENAME}); {fix}")
    qcfg = config.get("quantization_config")
    if qcfg:
        method = qcfg.get("quant_method", "unknown method") if isinstance(qcfg, dict) else qcfg
        raise QuantizeError(f"{model_dir} is already quantized (config.json: quantization_config {method!r}); {fix}")


def checked_output(model_dir: Path, out_dir: Path, *, overwrite: bool) -> Path:
    """The resolved output directory, after refusing every output that would touch the input or a user's files.

    Refused always: the input itself, a directory inside the input, a directory that contains the input (replacing
    it would delete the input), an existing path that is not a directory. Refused unless ``overwrite``: a non-empty
    directory. An absent path or an empty directory is fine.
    """
    src, out = model_dir.resolve(), out_dir.resolve()
    new = "choose a new output directory"
    if out == src:
        raise QuantizeError(f"the output directory {out_dir} is the input checkpoint; {new}")
    if src in out.parents:
        raise QuantizeError(f"the output directory {out_dir} is inside the input checkpoint {model_dir}; {new}")
    if out in src.parents:
        raise QuantizeError(
            f"the output directory {out_dir} contains the input checkpoint {model_dir} (replacing it would delete "
            f"the input); {new}"
        )
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise QuantizeError(f"the output path {out_dir} lies under {blocking}, which is a file, not a directory; {new}")
    if out.exists() and not out.is_dir():
        raise QuantizeError(f"the output path {out_dir} exists and is not a directory; {new}")
    if out.is_dir() and not overwrite and not is_empty_dir(out):
        raise QuantizeError(
            f"the output directory {out_dir} exists and is not empty; {new} or pass --overwrite to replace it"
        )
    return out
