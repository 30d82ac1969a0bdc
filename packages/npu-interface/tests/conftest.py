# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Fixtures for the interface tests: a clean device selection per test and fake installed distributions."""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from vllm_npu.interface import EnvConfig, reset_device_selection
from vllm_npu.interface.settings import ENV_PREFIX

# Every variable of the VLLM_NPU_* schema (so a new one is covered without editing this list), and VLLM_PLUGINS.
_ENV = (*(ENV_PREFIX + name for name in EnvConfig.model_fields), "VLLM_PLUGINS")


@pytest.fixture(autouse=True)
def clean_device_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts without VLLM_NPU_* / VLLM_PLUGINS and with no cached device decision or kernel backend."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    reset_device_selection()
    yield
    reset_device_selection()


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Install a fake distribution on ``sys.path``: ``fake_dist(name, version, modules={...}, entry_points="...")``.

    The distribution is real as far as ``importlib.metadata`` is concerned (a ``.dist-info`` directory), which is
    exactly what vLLM's plugin loader and our registry read.
    """
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    added: list[str] = []

    def make(name: str, version: str, *, modules: dict[str, str] | None = None, entry_points: str = "") -> Path:
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
        for module, source in (modules or {}).items():
            (root / f"{module}.py").write_text(textwrap.dedent(source))
            added.append(module)
        importlib.invalidate_caches()
        return root

    yield make
    for module in added:
        sys.modules.pop(module, None)


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def plugin_log() -> Iterator[_ListHandler]:
    """Records of the ``vllm.vllm_npu`` loggers. (vLLM's logging config turns propagation off, so caplog may miss them.)"""
    logger = logging.getLogger("vllm.vllm_npu")
    handler = _ListHandler()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)
