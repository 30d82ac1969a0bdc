# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""LoRA adapters for tests: PEFT checkpoints written from scratch, and the merged-weights HF reference.

:func:`write_peft_adapter` writes what PEFT's ``save_pretrained`` writes for a LoRA on a causal LM:
``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules``) and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
``[out, r]`` per targeted linear module (``lora_embedding_A`` ``[r, vocab]`` / ``lora_embedding_B`` ``[hidden, r]``
for the token embedding). :func:`merge_adapters` writes a plain HF checkpoint whose weights are
``W + (alpha / r) * B @ A`` (the embedding table gets the transpose): the reference a LoRA request must match token for token.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_PROJECTIONS = ATTENTION + MLP
#: Token embeddings: PEFT names their factors ``lora_embedding_A`` / ``lora_embedding_B`` (no ``.weight``).
EMBEDDINGS = ("embed_tokens",)


def _linear_shapes(base_dir: Path) -> dict[str, tuple[int, int]]:
    """``{module name: (out, in)}`` of every 2-D ``*.weight`` in the base checkpoint."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = st.get_slice(name).get_shape()
                if name.endswith(".weight") and len(shape) == 2:
                    shapes[name[: -len(".weight")]] = (int(shape[0]), int(shape[1]))
    return shapes


def write_peft_adapter(
    base_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    targets: Sequence[str] = ALL_PROJECTIONS,
    rank: int = 8,
    alpha: int = 16,
    seed: int = 0,
    std: float = 0.1,
    config_overrides: dict | None = None,
) -> Path:
    """A PEFT LoRA adapter for the causal LM at ``base_dir``: random ``A`` and ``B`` (``std``) for every linear
    whose last name part is in ``targets``. ``config_overrides`` replaces fields of ``adapter_config.json`` (e.g. a
    target module the model does not have). Returns ``out_dir``."""
    import torch
    from safetensors.torch import save_file

    base, out = Path(base_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (n_out, n_in) in sorted(_linear_shapes(base).items()):
        if module.rsplit(".", 1)[-1] not in targets:
            continue
        prefix = f"base_model.model.{module}"
        if module.rsplit(".", 1)[-1] in EMBEDDINGS:  # weight [vocab, hidden]: A [r, vocab], B [hidden, r]
            tensors[f"{prefix}.lora_embedding_A"] = (torch.randn(rank, n_out, generator=gen) * std).contiguous()
            tensors[f"{prefix}.lora_embedding_B"] = (torch.randn(n_in, rank, generator=gen) * std).contiguous()
            continue
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) * std).contiguous()
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * std).contiguous()
    if not tensors:
        raise ValueError(f"no linear module of {base} matches targets {list(targets)}")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(set(targets)),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        **(config_overrides or {}),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def merge_adapters(
    base_dir: str | os.PathLike[str], adapter_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> Path:
    """A copy of the HF checkpoint ``base_dir`` with the adapter merged: ``W += (alpha / r) * B @ A`` for every
    adapted module (float32 math). Returns ``out_dir``."""
    from safetensors.torch import load_file, save_file

    base, adapter, out = Path(base_dir), Path(adapter_dir), Path(out_dir)
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out)
    for f in sorted(out.glob("*.safetensors")):
        weights = load_file(str(f))
        for name in list(weights):
            prefix = f"base_model.model.{name[: -len('.weight')]}"
            if f"{prefix}.lora_embedding_A" in lora:  # embedding [vocab, hidden] += scale * (B @ A)^T
                a, b = lora[f"{prefix}.lora_embedding_A"].float(), lora[f"{prefix}.lora_embedding_B"].float()
                w = weights[name]
                weights[name] = (w.float() + scale * (b @ a).t()).to(w.dtype).contiguous()
            elif f"{prefix}.lora_A.weight" in lora:
                a, b = lora[f"{prefix}.lora_A.weight"].float(), lora[f"{prefix}.lora_B.weight"].float()
                w = weights[name]
                weights[name] = (w.float() + scale * (b @ a)).to(w.dtype).contiguous()
        save_file(weights, str(f), metadata={"format": "pt"})
    return out
