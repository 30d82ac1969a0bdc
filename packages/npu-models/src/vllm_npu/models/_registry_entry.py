# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Our model classes' entries in vLLM's ``ModelRegistry``: imported lazily, their inspection cached on our sources.

vLLM learns what a lazily registered class supports (generation, pooling, multimodal, pipeline parallel, ...) by
importing it in a subprocess (``_run_in_subprocess``: a Python start that imports vLLM and the model, 5-25 s) in every
front-end process that builds a config for it, and caches the answer under ``$VLLM_CACHE_ROOT/modelinfos`` keyed by
the md5 of ``vllm/model_executor/models/<last part of the module name>.py``. For a class of ours that file is vLLM's,
not ours: where vLLM has no file of that name (``multimodal``, ``deepseek_v32``, ``pangu_moe``) nothing is cached and
every ``vllm serve`` of those models pays the subprocess; where it has one (``qwen_vl``, ``qwen3_next``) the answer is
keyed on vLLM's file and outlives changes to ours. :class:`NPULazyModel` keys it on what the answer depends on: our
sources (every ``.py`` file of the class's package, where its mixins live too) and vLLM's version (the bases).
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.model_executor.models import registry as vllm_registry


def sources_key(module_name: str) -> str | None:
    """md5 (hex) of vLLM's version and the name and bytes of every ``.py`` file in ``module_name``'s package
    directory; None when the module has no source file (the answer is then not cached). Imports the parent packages
    only (``find_spec``), never the module."""
    import vllm

    spec = importlib.util.find_spec(module_name)
    origin = spec.origin if spec is not None else None
    if origin is None or not origin.endswith(".py"):
        return None
    digest = hashlib.md5(f"vllm {vllm.__version__}\n".encode(), usedforsecurity=False)
    for path in sorted(Path(origin).parent.glob("*.py")):
        digest.update(f"{path.name}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class NPULazyModel(vllm_registry._LazyRegisteredModel):
    """vLLM's lazily imported registry entry, with :meth:`inspect_model_cls` cached on :func:`sources_key`."""

    def cache_key(self) -> str | None:
        """The key of this entry's cached inspection (:func:`sources_key` of its module)."""
        return sources_key(self.module_name)

    def inspect_model_cls(self) -> Any:
        key = self.cache_key()
        if key is not None and (cached := self._load_modelinfo_from_cache(key)) is not None:
            return cached
        # In a subprocess, as vLLM does: importing a model module may initialise the device runtime.
        info = vllm_registry._run_in_subprocess(lambda: vllm_registry._ModelInfo.from_model_cls(self.load_model_cls()))
        if key is not None:
            self._save_modelinfo_to_cache(info, key)
        return info


def registry_entry(target: str) -> Any:
    """The registry entry for ``"module:Class"`` (what ``ModelRegistry.models[arch]`` holds)."""
    module_name, _, class_name = target.partition(":")
    return NPULazyModel(module_name, class_name)
