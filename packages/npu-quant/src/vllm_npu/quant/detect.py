# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Checkpoint detection for the ``ascend`` quant method, for the platform to call.

vLLM asks quant configs about a checkpoint only when ``config.json`` has a ``quantization_config``; new msModelSlim
exports drop it and ship ``quant_model_description.json`` instead. :func:`claim_checkpoint` covers them: the
platform calls it from ``NPUPlatform.check_and_update_config`` (which vLLM calls after it built the quant config),
and it selects ``ascend`` when the model directory has a description and the user chose no method.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_npu.interface import get_logger

from .description import DESCRIPTION_FILENAME, find_description_file

QUANT_METHOD = "ascend"

logger = get_logger(__name__)


def add_cli_choice(parser: argparse.ArgumentParser | None) -> bool:
    """Add ``ascend`` to the choices of ``--quantization``/``-q`` in ``parser`` (and its subparsers). Idempotent.

    Returns True if an option was found."""
    if parser is None:
        return False
    found = False
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in getattr(p, "_actions", []):
            if "--quantization" in getattr(action, "option_strings", ()):
                found = True
                if action.choices is not None and QUANT_METHOD not in action.choices:
                    action.choices = [*action.choices, QUANT_METHOD]
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    return found


def claim_checkpoint(vllm_config: Any) -> bool:
    """Select the ``ascend`` method for a local checkpoint that has ``quant_model_description.json`` when vLLM has
    not chosen a quant method. Returns True if it claimed the checkpoint. Never touches other checkpoints."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or model_config.quantization is not None:
        return False
    if find_description_file(model_config.model) is None:
        return False
    from vllm.config import VllmConfig

    from .config import register

    register()
    logger.info("%s found in %s: using quantization 'ascend'", DESCRIPTION_FILENAME, model_config.model)
    model_config.quantization = QUANT_METHOD
    vllm_config.quant_config = VllmConfig._get_quantization_config(model_config, vllm_config.load_config)
    return True
