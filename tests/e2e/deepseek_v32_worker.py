"""A test-only worker for the DeepSeek-V3.2 e2e tests, until npu-platform binds several KV-cache layers per decoder
layer.

DeepSeek-V3.2 has two cache layers in every decoder layer (the MLA latent cache ``...self_attn.attn`` and the
indexer key cache ``...self_attn.indexer.k_cache``). vLLM 0.11's ``bind_kv_cache`` (``vllm/v1/worker/utils.py``)
raises ``NotImplementedError`` for that on every platform but CUDA/XPU, although ``GPUModelRunner`` (which
``NPUModelRunner`` is) handles it: ``runner_kv_caches`` keeps one cache per layer index, and the forward context gets
every layer's cache. :func:`bind_kv_cache_per_layer` does exactly that; :class:`V32TestWorker` uses it while the
runner initialises its KV cache. The lasting fix belongs in ``NPUModelRunner.initialize_kv_cache_tensors``.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

from vllm_npu.platform.worker import NPUWorker


def bind_kv_cache_per_layer(
    kv_caches: dict[str, Any], forward_context: dict[str, Any], runner_kv_caches: list[Any], num_attn_module: int = 1
) -> None:
    """vLLM's ``bind_kv_cache`` where several cache layers may share a decoder-layer index (the CUDA behaviour)."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.worker.utils import bind_kv_cache

    first: dict[int, str] = {}
    for name in kv_caches:
        first.setdefault(extract_layer_index(name, num_attn_module), name)
    bind_kv_cache({n: kv_caches[n] for n in first.values()}, forward_context, runner_kv_caches, num_attn_module)
    for name, kv_cache in kv_caches.items():
        forward_context[name].kv_cache = [kv_cache]


class V32TestWorker(NPUWorker):
    def initialize_from_config(self, kv_cache_config: Any) -> None:
        with mock.patch("vllm.v1.worker.gpu_model_runner.bind_kv_cache", bind_kv_cache_per_layer):
            super().initialize_from_config(kv_cache_config)
