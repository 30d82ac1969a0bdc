# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The one resolver of ``"module:attr"`` strings (hooks, CustomOp tables, lazy exports, patch factories, CLI commands).

Every layer names what it registers as a string, so nothing is imported until it is used. This module turns such a
string into the object, and says which string (and who named it) when the string is malformed or points at nothing.
"""

from __future__ import annotations

import importlib
from typing import Any


def import_target(target: str, *, package: str | None = None, what: str = "target") -> Any:
    """Import ``"package.module:attr"`` and return the attribute (``attr`` may be dotted: ``"mod:Class.method"``).

    ``package`` anchors a relative module (``".module:attr"``), as in :func:`importlib.import_module`. ``what`` names
    the string's role in the error messages (``"hook of npu-ops"``, ``"CustomOp override"``).

    Raises ValueError when ``target`` is not of the form ``module:attr``; ModuleNotFoundError when the module itself
    does not exist (a module that exists but fails to import raises its own error, unchanged, so bugs are not
    hidden); AttributeError when the module lacks the attribute.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr or ":" in attr or not all(p.isidentifier() for p in attr.split(".")):
        raise ValueError(f"{what} {target!r} must look like 'package.module:attr'")
    try:
        module = importlib.import_module(module_name, package)
    except ModuleNotFoundError as exc:
        from importlib.util import resolve_name  # only on this error path: the module is on vLLM's start-up path

        absolute = resolve_name(module_name, package) if module_name.startswith(".") else module_name
        if exc.name is not None and (absolute == exc.name or absolute.startswith(exc.name + ".")):
            raise ModuleNotFoundError(
                f"{what} {target!r}: no module named {exc.name!r} (is the package that provides it installed?)",
                name=exc.name,
            ) from exc
        raise
    value: Any = module
    for i, part in enumerate(attr.split(".")):
        try:
            value = getattr(value, part)
        except AttributeError:
            owner = ".".join([module.__name__, *attr.split(".")[:i]])
            raise AttributeError(f"{what} {target!r}: {owner} has no attribute {part!r}") from None
    return value
