# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Checkpoint detection for the ``ascend`` quant method, for the platform to call.

vLLM asks quant configs about a checkpoint only when ``config.json`` has a ``quantization_config``; new msModelSlim
exports drop it and ship ``quant_model_description.json`` instead. :func:`claim_checkpoint` (from
``NPUPlatform.check_and_update_config``, which vLLM calls after it built the quant config) selects ``ascend`` when
the model directory has a description and the user chose nothing else. (``--quantization ascend`` needs no CLI
wiring: vLLM 0.11's option has no argparse choices and validates against the registered methods.) The detection
rules are :mod:`vllm_npu.interface.quant_checkpoint`'s, which the platform applies to refuse these checkpoints with the
install command when this layer is absent.
"""

from __future__ import annotations

from typing import Any

from vllm_npu.interface import DESCRIPTION_FILENAME, QUANT_METHOD, find_description_file, get_logger

__all__ = ["QUANT_METHOD", "claim_checkpoint"]

logger = get_logger(__name__)


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
