# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Loggers under vLLM's ``vllm.`` namespace: only that logger has vLLM's handlers, so plugin lines elsewhere vanish."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """``get_logger(__name__)`` -> the ``vllm.vllm_npu.<...>`` logger (does not import vLLM)."""
    return logging.getLogger(name if name.startswith("vllm.") else f"vllm.{name}")
