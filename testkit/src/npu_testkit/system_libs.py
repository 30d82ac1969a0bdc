# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The tests' side of ``scripts/system_libs.py``: tests that load the Mooncake transfer engine call
:func:`require_mooncake_libraries` first, so a machine without its Debian libraries gets one message naming the apt
line (the script's own text) on each of those tests, not a collection error or a loader traceback. They fail, never
skip: a missing library is a broken set-up, and a skip would let a run without the transfer tests look green.

The testkit is private and used from a checkout only, so the script is found next to it in the tree.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "system_libs.py"


@cache
def system_libs() -> ModuleType:
    """``scripts/system_libs.py`` as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("_scripts_system_libs", SCRIPT)
    assert spec and spec.loader, SCRIPT
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def missing_message() -> str | None:
    """The script's message when a library is missing, else None."""
    libs = system_libs()
    absent = libs.missing()
    return libs.message(absent) if absent else None


def require_mooncake_libraries() -> None:
    """Fail the calling test (or fixture) with the apt line when a library the Mooncake engine links is missing."""
    text = missing_message()
    if text is not None:
        pytest.fail(text, pytrace=False)
