# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Lazy public APIs: a package door (``__init__.py``) that names its exports without importing them.

vLLM loads plugins in every process, and discovering a component imports its package, so a layer's
``__init__.py`` must not import torch or vLLM. ``lazy_exports`` builds the module ``__getattr__``/``__dir__`` pair
(PEP 562) that imports an export on first access.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .targets import import_target


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``exports`` maps a public name to ``".module:attr"`` (relative to ``package``) or ``"abs.module:attr"``."""

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return import_target(target, package=package, what=f"lazy export {name!r} of {package}")

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
