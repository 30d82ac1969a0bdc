# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Shared fixtures: throw-away target and factory modules written to disk (so ``inspect.getsource`` works)."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

TARGET_SOURCE = '''
def greet(name):
    """Say hello."""
    return "hello " + name


def helper(x):
    return x + 1


class Base:
    def speak(self):
        return "base"

    @staticmethod
    def static():
        return "static"


class Child(Base):
    pass
'''

#: Replacement factories ``f(original) -> new`` for the targets above.
FACTORY_SOURCE = """
def shout(original):
    def greet(name):
        return original(name).upper()
    return greet


def speak_patched(original):
    def speak(self):
        return "patched"
    return speak


def static_patched(original):
    return staticmethod(lambda: "patched static")
"""


@dataclass
class Fake:
    """A fresh target module (``mod``) and the ``module:`` prefix of the factories (``fac``)."""

    mod: ModuleType
    fac: str
    root: Path

    def rewrite(self, source: str) -> ModuleType:
        """Replace the target module's source and reload it (simulates a changed vLLM)."""
        Path(self.mod.__file__).write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        import linecache

        linecache.clearcache()
        self.mod = importlib.reload(self.mod)
        return self.mod


def _write(root: Path, prefix: str, source: str) -> ModuleType:
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    (root / f"{name}.py").write_text(textwrap.dedent(source))
    importlib.invalidate_caches()
    return importlib.import_module(name)


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Fake]:
    sys.path.insert(0, str(tmp_path))
    mod = _write(tmp_path, "npu_patches_target", TARGET_SOURCE)
    fac = _write(tmp_path, "npu_patches_factories", FACTORY_SOURCE)
    yield Fake(mod, fac.__name__ + ":", tmp_path)
    sys.path.remove(str(tmp_path))
    sys.modules.pop(mod.__name__, None)
    sys.modules.pop(fac.__name__, None)


@pytest.fixture
def vllm_unpatched() -> Iterator[None]:
    """vLLM as shipped for the duration of a test: patches the process-wide registry applied (e.g. by an engine
    started earlier in this pytest process) are reverted first and put back afterwards."""
    from vllm_npu.interface import distribution_version
    from vllm_npu.patches import PatchStatus, get_registry

    reg = get_registry()
    applied = [r.id for r in reg.records() if r.status is PatchStatus.APPLIED]
    reg.revert(ids=applied)
    yield
    for pid in applied:
        rec = reg.record(pid)
        reg._apply_one(rec, reg._verify(rec.patch, distribution_version("vllm")))
