# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``host-offload-npu``'s handler on the emulated device: blocks of every cache kind go to host memory and come back
into other device blocks bit for bit, with offloaded blocks larger than device blocks; vLLM's spec yields it."""

from __future__ import annotations

import pytest
import torch
from vllm_npu.patches.sets.host_offload import HostOffloadHandler, block_pairs, cache_planes


def _specs():
    from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec

    return GPULoadStoreSpec, CPULoadStoreSpec


def test_mla_cache_is_two_planes_latent_first() -> None:
    nb, bs, lora, rope = 3, 4, 6, 2
    cache = torch.arange(nb * bs * (lora + rope), dtype=torch.float32).view(nb, bs, lora + rope)
    latent, pe = cache_planes(cache, lora)
    assert latent.shape == (nb, bs * lora) and pe.shape == (nb, bs * rope)
    # npu-attention's layout (ops/mla_cache.py:latent_cache_planes): all latents, then all rope keys
    assert latent[1, 0].item() == bs * lora and pe[0, 0].item() == nb * bs * lora
    assert [p.shape for p in cache_planes(torch.zeros(2, nb, bs, 2, 8), None)] == [(nb, bs, 2, 8)] * 2


def test_block_pairs_expand_offloaded_blocks() -> None:
    import numpy as np

    pairs = block_pairs(np.array([5, 6, 7]), 1, np.array([1, 3]), 2)  # 3 device blocks into 2 double blocks
    assert pairs.tolist() == [[5, 3], [6, 6], [7, 7]]  # the first host block's leading half is skipped
    with pytest.raises(ValueError, match="sub-blocks"):
        block_pairs(np.array([5, 6, 7]), 1, np.array([1]), 2)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_round_trip_through_host_memory(kind: str) -> None:
    gpu, cpu = _specs()
    if kind == "gqa":
        caches = {"l0": torch.randn(2, 8, 4, 2, 8), "l1": torch.randn(2, 8, 4, 2, 8)}
        lora = None
    else:
        caches = {"l0": torch.randn(8, 4, 10)}
        lora = 8
    caches["l0_shared"] = caches["l0"]  # a layer sharing another's cache is copied once
    before = {k: v.clone() for k, v in caches.items()}
    handler = HostOffloadHandler(caches, 4, 8, num_cpu_blocks=4, kv_lora_rank=lora)
    assert handler.transfer_async(1, (gpu([2, 3, 6, 7]), cpu([0, 3])))
    assert handler.get_finished() == [(1, True)] and handler.get_finished() == []
    assert handler.transfer_async(2, (cpu([3]), gpu([0, 1])))
    assert handler.get_finished() == [(2, True)]
    for name, cache in caches.items():
        old = before[name]
        if kind == "gqa":
            assert torch.equal(cache[:, 0], old[:, 6]) and torch.equal(cache[:, 1], old[:, 7])
            assert torch.equal(cache[:, 2:], old[:, 2:])
        else:
            for plane_new, plane_old in zip(cache_planes(cache, lora), cache_planes(old, lora)):
                assert torch.equal(plane_new[0], plane_old[6]) and torch.equal(plane_new[1], plane_old[7])
                assert torch.equal(plane_new[2:], plane_old[2:])


def test_spec_yields_the_handler_off_cuda() -> None:
    from types import SimpleNamespace

    from vllm_npu.patches.sets.host_offload import make_replacement

    def cuda_only(self, kv_caches):  # vLLM 0.11.0's behaviour off CUDA
        raise AssertionError("vLLM's CUDA handler was asked for")
        yield

    spec = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(use_mla=False, hf_text_config=None)),
        gpu_block_size=4,
        offloaded_block_size=4,
        num_cpu_blocks=2,
        _handler=None,
    )
    handlers = list(make_replacement(cuda_only)(spec, {"l0": torch.zeros(2, 3, 4, 1, 2)}))
    gpu, cpu = _specs()
    assert [(a, b) for a, b, _ in handlers] == [(gpu, cpu), (cpu, gpu)]
    assert isinstance(handlers[0][2], HostOffloadHandler) and handlers[0][2] is handlers[1][2]
