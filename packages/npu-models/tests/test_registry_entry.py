# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Our ``ModelRegistry`` entries: vLLM's inspection of a class of ours (a subprocess that imports vLLM and the model)
runs once per source state and vLLM version, then comes from ``$VLLM_CACHE_ROOT/modelinfos`` -- also for modules
whose name no vLLM model file has (vLLM's own entry never caches those: every front-end start paid the subprocess)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel, _ModelInfo
from vllm_npu.models import MODEL_OVERRIDES, register_models
from vllm_npu.models import _registry_entry as entry_mod

INFO = _ModelInfo.from_model_cls(Qwen2ForCausalLM)


@pytest.fixture
def subprocess_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[str]]:
    """``VLLM_CACHE_ROOT`` in ``tmp_path``; the inspection subprocess replaced by a recorder returning :data:`INFO`."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    runs: list[str] = []

    def run(fn):  # what vLLM's _run_in_subprocess would return, without the 5-25 s start
        runs.append("run")
        return INFO

    monkeypatch.setattr(sys.modules[_LazyRegisteredModel.__module__], "_run_in_subprocess", run)
    yield runs


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package ``npu_reg_probe`` with a model module and a sibling, importable from ``tmp_path``."""
    pkg = tmp_path / "src" / "npu_reg_probe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "multimodal.py").write_text("class Model: ...\n")
    (pkg / "mixins.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    for name in [m for m in sys.modules if m.startswith("npu_reg_probe")]:
        monkeypatch.delitem(sys.modules, name)  # an earlier test's copy of the package lives elsewhere
    return pkg


def test_every_override_is_our_cached_entry() -> None:
    register_models()
    for arch, target in MODEL_OVERRIDES.items():
        entry = ModelRegistry.models[arch]
        assert isinstance(entry, entry_mod.NPULazyModel), arch
        assert f"{entry.module_name}:{entry.class_name}" == target


def test_inspection_runs_once_then_comes_from_the_cache(subprocess_runs: list[str], package: Path) -> None:
    entry = entry_mod.NPULazyModel("npu_reg_probe.multimodal", "Model")
    assert entry.inspect_model_cls() == INFO
    assert entry.inspect_model_cls() == INFO
    assert entry_mod.NPULazyModel("npu_reg_probe.multimodal", "Model").inspect_model_cls() == INFO
    assert subprocess_runs == ["run"]


def test_vllm_s_own_entry_never_caches_a_module_name_it_has_no_file_for(
    subprocess_runs: list[str], package: Path
) -> None:
    """Why the entry exists: vLLM keys the cache on ``vllm/model_executor/models/multimodal.py``, which is absent."""
    entry = _LazyRegisteredModel("npu_reg_probe.multimodal", "Model")
    entry.inspect_model_cls()
    entry.inspect_model_cls()
    assert subprocess_runs == ["run", "run"]


@pytest.mark.parametrize("changed", ["multimodal.py", "mixins.py", "vllm"])
def test_a_change_to_our_sources_or_vllm_inspects_again(
    subprocess_runs: list[str], package: Path, changed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = entry_mod.NPULazyModel("npu_reg_probe.multimodal", "Model")
    before = entry_mod.sources_key(entry.module_name)
    entry.inspect_model_cls()
    if changed == "vllm":
        import vllm

        monkeypatch.setattr(vllm, "__version__", vllm.__version__ + ".post1")
    else:
        (package / changed).write_text((package / changed).read_text() + "# edited\n")
    assert entry_mod.sources_key(entry.module_name) != before
    entry.inspect_model_cls()
    assert subprocess_runs == ["run", "run"]


def test_a_module_without_a_source_file_is_inspected_every_time(subprocess_runs: list[str]) -> None:
    entry = entry_mod.NPULazyModel("math", "pi")  # a built-in module: no .py origin, nothing to key on
    assert entry_mod.sources_key("math") is None
    entry.inspect_model_cls()
    entry.inspect_model_cls()
    assert subprocess_runs == ["run", "run"]
