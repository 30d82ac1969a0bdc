# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vLLM's compilation level across the 0.11 line, for the layers that set it (the platform's graph modes) or read it
(the attention layer: is the model traced?).

vLLM 0.11.0 keeps it in ``CompilationConfig.level`` (``CompilationLevel``: 0 no compilation ... 3 piecewise); 0.11.1
renamed it ``CompilationConfig.mode`` (``CompilationMode``: 0 ``NONE`` ... 3 ``VLLM_COMPILE``, the same numbers) and
maps a ``level`` given by the user onto ``mode`` in ``__post_init__``, after which ``level`` is dead. These helpers
read what the installed vLLM has. Import-light: vLLM is imported only to build 0.11.1's enum value."""

from __future__ import annotations

from typing import Any

#: No torch.compile: the model runs as written (0.11.0 ``NO_COMPILATION``, 0.11.1 ``NONE``).
NO_COMPILATION = 0
#: vLLM's piecewise Dynamo compilation (0.11.0 ``PIECEWISE``, 0.11.1 ``VLLM_COMPILE``).
PIECEWISE = 3


def _has_mode(compilation_config: Any) -> bool:
    return hasattr(type(compilation_config), "mode") or "mode" in getattr(compilation_config, "__dict__", {})


def compilation_level(compilation_config: Any) -> int | None:
    """The compilation level (None: vLLM's default, not resolved yet) of a ``CompilationConfig``."""
    value = compilation_config.mode if _has_mode(compilation_config) else compilation_config.level
    return None if value is None else int(value)


def set_compilation_level(compilation_config: Any, level: int) -> None:
    """Set the compilation level (:data:`NO_COMPILATION` or :data:`PIECEWISE`) where the installed vLLM reads it."""
    if _has_mode(compilation_config):
        from vllm.config.compilation import CompilationMode  # type: ignore[attr-defined, unused-ignore]

        compilation_config.mode = CompilationMode(level)
    else:
        compilation_config.level = level
