# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The refusal of msModelSlim checkpoints when the quant layer is absent (not installed, or left out by
``VLLM_PLUGINS``): a :class:`~vllm_npu.interface.errors.MissingComponentError` naming the checkpoint, the scheme
seen and the fix, instead of vLLM's "Unknown quantization method: ascend" or a silent float load.

The checkpoint is recognised by :mod:`vllm_npu.interface.quant_checkpoint` (the rules npu-quant claims by). Two
paths, because vLLM sees the two kinds of checkpoint at different times:

- ``config.json`` has a ``quantization_config`` (``quant_method: ascend`` or an old-style description), or the user
  passed ``--quantization ascend``: ``ModelConfig`` rejects a method no one registered before any platform hook sees
  the model path. So :func:`register_gate` (from ``NPUPlatform.pre_register_and_update``, which vLLM calls before it
  builds the ``ModelConfig``) registers :class:`MissingQuantLayerConfig` as ``ascend``; it claims the same checkpoints
  npu-quant would, lets vLLM's checks pass, and raises in ``maybe_update_config(model)``, the first call that gets
  the model path.
- only ``quant_model_description.json``: vLLM never consults a quant config; ``NPUPlatform.check_and_update_config``
  raises :func:`missing_quant_layer` when it finds the file.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm_npu.interface import (
    QUANT_METHOD,
    MissingComponentError,
    get_logger,
    is_msmodelslim_quant_config,
    once,
    read_scheme,
    require,
)

logger = get_logger(__name__)


def missing_quant_layer(model: str | None, source: str, scheme: str) -> MissingComponentError:
    """The error for the msModelSlim checkpoint ``model`` (its path or name; None if unknown; ``source``: where it
    was recognised; ``scheme``: what it declares) with the quant layer absent. The fix is ``require()``'s: the pip
    command, or the ``VLLM_PLUGINS`` fix when the layer is installed but left out."""
    what = f"the checkpoint {model!r}" if model is not None else "the checkpoint"
    reason = (
        f"{what} is msModelSlim-quantized ({source}; scheme {scheme}) and needs the {QUANT_METHOD!r} quantization "
        "method of the quant layer"
    )
    try:
        require("quant", reason)
    except MissingComponentError as exc:
        return exc
    # The layer became available after the gate was registered (installed mid-process): a restart picks it up.
    return MissingComponentError(
        "quant", reason, fix="the quant layer was not loaded when this process started: restart the process"
    )


class MissingQuantLayerConfig(QuantizationConfig):
    """``ascend`` while npu-quant is absent: recognises msModelSlim checkpoints and refuses them with the fix.

    Nothing is ever loaded through it: ``maybe_update_config`` (called by vLLM right after building the config,
    before any weight or layer exists) and ``get_quant_method`` raise."""

    def __init__(self, hf_quant_cfg: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.hf_quant_cfg = hf_quant_cfg

    @classmethod
    def get_name(cls) -> str:  # type: ignore[override]  # vLLM's Literal lists only its built-in methods
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        # vLLM checks the model dtype against this before maybe_update_config: every dtype passes, so the user
        # gets the missing-layer error, not a dtype complaint about a method that is not there.
        from .platform import MODEL_DTYPES

        return list(MODEL_DTYPES)

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        # None: vLLM then builds the config without looking for the description file, whose absence would be
        # reported as "Cannot find the config file for ascend" before the missing layer.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MissingQuantLayerConfig:
        return cls(config)

    @classmethod
    def override_quantization_method(  # type: ignore[override]  # the same Literal, see get_name
        cls, hf_quant_cfg: Any, user_quant: str | None
    ) -> str | None:
        # The same checkpoints npu-quant's config claims, so an old-style description in config.json (no
        # quant_method) is refused instead of loading as float weights.
        if user_quant in (None, QUANT_METHOD) and is_msmodelslim_quant_config(hf_quant_cfg):
            return QUANT_METHOD
        return None

    def _source(self) -> str:
        if self.hf_quant_cfg is not None:
            return "config.json quantization_config"
        return f"--quantization {QUANT_METHOD}"

    def maybe_update_config(self, model_name: str) -> None:
        raise missing_quant_layer(model_name, self._source(), read_scheme(model_name, self.hf_quant_cfg))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        raise missing_quant_layer(None, self._source(), read_scheme(None, self.hf_quant_cfg))


def register_gate() -> None:
    """Register :class:`MissingQuantLayerConfig` as ``ascend`` unless a method of that name is registered (npu-quant's,
    or another plugin's: never fight over the name). Once per process."""

    def _do() -> None:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

        if QUANT_METHOD not in QUANTIZATION_METHODS:
            register_quantization_config(QUANT_METHOD)(MissingQuantLayerConfig)
            logger.debug("the quant layer is absent: %r refuses msModelSlim checkpoints with the fix", QUANT_METHOD)

    once("npu-platform:quant-gate", _do)
