# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The pool's keys and its scheduler-side manager (vLLM's ``OffloadingManager`` interface, so vLLM's own offloading
scheduler logic decides what to load and store, and when a finished request's blocks may be freed).

A pool object is one vLLM KV block of one TP rank, all layers: key ``vllm-npu/<namespace>/<block hash>/<part>``.
``<block hash>`` is vLLM's prefix block hash (it chains every earlier block of the prompt, so a hit on block ``i``
means the whole prefix up to ``i`` matched). ``<namespace>`` fingerprints what the bytes depend on: the model, its
dtype and KV cache dtype, the block size, the TP/PP layout and the hash function; two deployments that differ in any
of these never read each other's KV. ``<part>`` is ``tp<rank>`` for a per-rank cache (GQA heads split over ranks)
and ``mla`` for the MLA latent cache, which every rank holds whole (rank 0 stores it, every rank loads it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager, PrepareStoreOutput

from .store import PoolStore

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHash


def namespace(vllm_config: Any) -> str:
    """A short fingerprint of the KV layout this deployment writes (see the module docstring)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    fields = {
        "model": str(mc.model),
        "revision": str(getattr(mc, "revision", None)),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "block_size": int(cc.block_size),
        "tp": int(pc.tensor_parallel_size),
        "pp": int(pc.pipeline_parallel_size),
        "mla": bool(mc.use_mla),
        "layers": int(mc.get_num_layers(pc)),
        "kv_heads": int(mc.get_num_kv_heads(pc)),
        "head_size": int(mc.get_head_size()),
        "hash": str(getattr(cc, "prefix_caching_hash_algo", "")),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def parts(tp_size: int, replicated: bool) -> list[str]:
    """The key parts one block is stored under (one per TP rank, or the one shared MLA part)."""
    return ["mla"] if replicated else [f"tp{r}" for r in range(tp_size)]


def part_of(tp_rank: int, replicated: bool) -> str:
    return "mla" if replicated else f"tp{tp_rank}"


def block_key(ns: str, block_hash: bytes, part: str) -> str:
    return f"vllm-npu/{ns}/{bytes(block_hash).hex()}/{part}"


class PoolLoadStoreSpec(LoadStoreSpec):
    """The pool side of a transfer: the blocks' prefix hashes, in request order."""

    def __init__(self, block_hashes: Iterable[BlockHash]) -> None:
        self.block_hashes: list[bytes] = [bytes(h) for h in block_hashes]

    @staticmethod
    def medium() -> str:
        return "MOONCAKE_POOL"

    def __repr__(self) -> str:
        return f"PoolLoadStoreSpec({len(self.block_hashes)} blocks)"


class PoolManager(OffloadingManager):
    """Scheduler side: asks the pool which prefix blocks it holds. The pool evicts on its own (the master's
    lease and eviction settings), so there is no local bookkeeping: every block offered is stored (the workers skip
    the ones the pool already holds), and a block evicted between lookup and load fails that load, which the
    scheduler recomputes."""

    def __init__(self, store: PoolStore, ns: str, key_parts: list[str]) -> None:
        self.store = store
        self.ns = ns
        self.key_parts = key_parts

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, every TP rank's part of is in the pool."""
        hashes = list(block_hashes)
        if not hashes or not self.store.available:
            return 0
        keys = [block_key(self.ns, h, p) for h in hashes for p in self.key_parts]
        present = self.store.exists(keys)
        n = len(self.key_parts)
        hits = 0
        for i in range(len(hashes)):
            if not all(present[i * n : (i + 1) * n]):
                break
            hits += 1
        return hits

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        return PoolLoadStoreSpec(block_hashes)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Nothing: the pool's master tracks recency itself."""

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """Nothing: a load holds nothing in the pool."""

    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        hashes = list(block_hashes)
        if not self.store.available:
            # No pool: nothing to store (the request's blocks are freed at once).
            return PrepareStoreOutput(
                block_hashes_to_store=[], store_spec=PoolLoadStoreSpec([]), block_hashes_evicted=[]
            )
        return PrepareStoreOutput(
            block_hashes_to_store=hashes, store_spec=PoolLoadStoreSpec(hashes), block_hashes_evicted=[]
        )

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Nothing: the workers' puts are what makes a block loadable."""
