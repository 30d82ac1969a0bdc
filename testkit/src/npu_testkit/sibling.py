# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Import a helper module that sits next to a test file (pytest runs with ``--import-mode=importlib``, so a test
folder is not on ``sys.path`` and ``import qwen_vl_cases`` would fail)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


def import_sibling(test_file: str | os.PathLike[str], name: str) -> ModuleType:
    """The module ``<folder of test_file>/<name>.py``, imported once per process under the plain name ``name`` (every
    test module that loads it shares that one module object)."""
    if name not in sys.modules:
        path = Path(test_file).parent / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no helper module {name!r} at {path}: put {name}.py next to {Path(test_file).name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
