# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""What npu-models says it overrides is what it registers: every place that lists the model overrides (the
package description, the component summary, the root README's package table, the package README's override table)
names exactly the architectures of ``MODEL_OVERRIDES``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from vllm_npu.models._component import COMPONENT
from vllm_npu.models._hooks import MODEL_OVERRIDES

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "packages" / "npu-models"
# HF architecture names as vLLM's ModelRegistry keys them (`DeepseekV32ForCausalLM`, `Qwen2VLForConditionalGeneration`),
# and the few named otherwise (`InternVLChatModel`, `Qwen2_5OmniModel`, `MiniCPMV`, the MTP draft `Qwen3NextMTP`).
ARCHITECTURE = re.compile(
    r"\b(?:[A-Z][A-Za-z0-9_]*For(?:CausalLM|ConditionalGeneration)|InternVLChatModel|Qwen2_5OmniModel|MiniCPMV|Qwen3NextMTP)\b"
)


# Our override classes look like architectures too (`AscendDeepseekV32ForCausalLM`); they are not claims.
OVERRIDE_CLASSES = {target.rpartition(":")[2] for target in MODEL_OVERRIDES.values()}


# Model families a reader may look for; naming one that no override belongs to is the false claim guarded here.
FAMILIES = ("qwen", "pangu", "deepseek", "llama", "glm", "minicpm", "internvl", "kimi", "mistral", "gemma")


def _architectures(text: str) -> set[str]:
    """The architectures ``text`` claims. A model family named without an override of that family fails here."""
    archs = set(ARCHITECTURE.findall(text)) - OVERRIDE_CLASSES
    covered = " ".join(MODEL_OVERRIDES).lower()
    unbacked = [f for f in FAMILIES if f in text.lower() and f not in covered]
    assert unbacked == [], f"names model families npu-models has no override for: {unbacked}: {text!r}"
    return archs


def _root_readme_row() -> str:
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `npu-models` |")]
    assert len(rows) == 1, rows
    return rows[0]


def test_the_registry_has_overrides() -> None:
    assert MODEL_OVERRIDES, "an empty override table would make every check below vacuous"


def test_package_description_names_exactly_the_overrides() -> None:
    description = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]["description"]
    assert _architectures(description) == set(MODEL_OVERRIDES), description


def test_component_summary_names_exactly_the_overrides() -> None:
    assert _architectures(COMPONENT.summary) == set(MODEL_OVERRIDES), COMPONENT.summary


def test_root_readme_row_names_exactly_the_overrides() -> None:
    row = _root_readme_row()
    assert _architectures(row) == set(MODEL_OVERRIDES), row


def test_package_readme_table_is_the_override_table() -> None:
    text = (PACKAGE / "README.md").read_text()
    table = text.split("## Model overrides", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| `([\w.:]+)` \|", table, flags=re.MULTILINE)
    assert dict(rows) == MODEL_OVERRIDES
    # No architecture is claimed anywhere else in the README either.
    assert _architectures(text) == set(MODEL_OVERRIDES)


#: Overrides that do not subclass vLLM's class, and why: vLLM 0.11's qwen3_next module imports its FLA Triton kernels at
#: import, which fails on a host without a working Triton (this one), so ours is built beside it.
STANDALONE = {"Qwen3NextForCausalLM", "Qwen3NextMTP"}


def test_vllm_registry_builds_each_declared_override() -> None:
    """The load hook's registration is what vLLM's ModelRegistry then resolves, and each override subclasses the
    class vLLM itself maps that architecture to (an override changes only what differs); an architecture vLLM does
    not know (no class of its own) needs only the registration."""
    import importlib

    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _VLLM_MODELS
    from vllm_npu.models._hooks import register_models

    register_models()
    for arch, target in MODEL_OVERRIDES.items():
        entry = ModelRegistry.models[arch]
        assert f"{entry.module_name}:{entry.class_name}" == target, (arch, entry)
        module, _, name = target.partition(":")
        ours = getattr(importlib.import_module(module), name)
        if arch in STANDALONE:
            # vLLM's own module for it fails to import on this host: ours must not import it either
            assert not any(m.startswith("vllm.model_executor.layers.fla") for m in sys.modules), arch
        elif arch in _VLLM_MODELS:
            vllm_module, vllm_name = _VLLM_MODELS[arch]
            base = getattr(importlib.import_module(f"vllm.model_executor.models.{vllm_module}"), vllm_name)
            assert issubclass(ours, base) and ours is not base, (arch, ours, base)
