# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vLLM's cached inspection of a checkpoint's model classes, written from the test process before an engine starts.

A front end that builds a config asks vLLM's ``ModelRegistry`` what the architecture's class supports; for a lazily
registered class vLLM answers by importing it in a subprocess (a Python start that imports vLLM: 8-25 s on the
2-core machine), unless ``$VLLM_CACHE_ROOT/modelinfos`` holds the answer. On a fresh CI machine that cache is empty,
so the first engine of each architecture paid the subprocess (17 of them in one suite run, 130 CPU-s). A test process
has vLLM imported already: :func:`warm_model_info` computes the same answer in it (vLLM's ``_ModelInfo.from_model_cls``
on the class the registry entry loads) and writes it where, and with the key, the entry itself would, so the engine
finds it. The answer is the entry's own function of the class; only where it runs differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def _entry_key(entry: Any) -> str | None:
    """The cache key ``entry.inspect_model_cls`` compares with (None: that entry never caches)."""
    from vllm.model_executor.models import registry

    key_of = getattr(entry, "cache_key", None)  # our entries (vllm_npu.models) key on our sources
    if callable(key_of):
        return key_of()
    if type(entry) is not registry._LazyRegisteredModel:
        return None
    # vLLM's own lazy entry: the md5 of its model file (registry.py, _LazyRegisteredModel.inspect_model_cls)
    path = Path(registry.__file__).parent / f"{entry.module_name.split('.')[-1]}.py"
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest() if path.exists() else None


def warm_model_info(model_dir: str | os.PathLike[str], archs: list[str] | None = None) -> list[str]:
    """Write the cached inspection of ``archs`` (default: the checkpoint's ``config.json`` architectures) under the
    current ``VLLM_CACHE_ROOT`` where it is missing or stale; returns the architectures written. Needs vLLM's
    platform resolved as the engine will (the plugins are loaded here, idempotently)."""
    from vllm.model_executor.models import registry
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # our overrides' entries, as the engine's front end sees them
    if archs is None:
        config_file = Path(model_dir) / "config.json"
        if not config_file.is_file():
            return []  # not a local checkpoint: the engine inspects as it would anyway
        archs = list(json.loads(config_file.read_text()).get("architectures") or [])
    written = []
    for arch in archs:
        entry = registry.ModelRegistry.models.get(arch)
        key = _entry_key(entry) if entry is not None else None
        if key is None or entry._load_modelinfo_from_cache(key) is not None:
            continue
        entry._save_modelinfo_to_cache(registry._ModelInfo.from_model_cls(entry.load_model_cls()), key)
        written.append(arch)
    return written
