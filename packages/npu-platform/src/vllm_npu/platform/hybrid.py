# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Config checks for hybrid models (attention layers plus Mamba-style state layers, e.g. Qwen3-Next's gated
delta-net): what vLLM 0.11 turns off or cannot do for them, stated by name at config time.

vLLM's ``MambaModelConfig`` silently sets ``enable_prefix_caching = False`` for every hybrid, and its hybrid KV-cache
manager (the only way to hold attention pages and state pages in one pool) is switched off by vLLM whenever a KV
connector or KV events are configured, or when the user disables it; the model then fails much later, in the KV-cache
planner ("failed to convert the KV cache specs to one unified type"). Here those cases are an error naming the cause
and the fix, and the silent change a warning.
"""

from __future__ import annotations

from typing import Any

from vllm_npu.interface import ConfigError, get_logger

logger = get_logger(__name__)


def _is_hybrid(vllm_config: Any) -> bool:
    model = vllm_config.model_config
    try:
        return bool(model is not None and model.is_hybrid)
    except Exception:  # noqa: BLE001 - a model config without registry info (tests' stand-ins) is no hybrid
        return False


def check_hybrid_config(vllm_config: Any) -> None:
    """Refuse what a hybrid model cannot run with on vLLM 0.11; warn about what vLLM turned off. No-op otherwise."""
    if not _is_hybrid(vllm_config):
        return
    arch = vllm_config.model_config.architecture
    if vllm_config.kv_transfer_config is not None:
        raise ConfigError(
            f"{arch} is a hybrid model (attention + recurrent state layers); vLLM 0.11 turns its hybrid KV-cache "
            "manager off when a KV connector is configured, and the state layers cannot be placed without it; remove "
            "--kv-transfer-config (prefill-decode disaggregation and KV offloading do not serve hybrid models yet)"
        )
    if vllm_config.kv_events_config is not None:
        raise ConfigError(
            f"{arch} is a hybrid model; vLLM 0.11 turns its hybrid KV-cache manager off when KV events are "
            "configured, and the state layers cannot be placed without it; remove --kv-events-config"
        )
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise ConfigError(
            f"{arch} is a hybrid model: its attention pages and recurrent-state pages share one pool only through "
            "vLLM's hybrid KV-cache manager; remove --disable-hybrid-kv-cache-manager"
        )
    logger.warning(
        "%s is a hybrid model: prefix caching is off (vLLM 0.11 does not cache recurrent state), and pipeline "
        "parallelism is not served for it by vllm-npu",
        arch,
    )
