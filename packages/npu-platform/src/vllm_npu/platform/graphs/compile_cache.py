# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The compile caches of the torchair mode and of the emulated device's compiled twin: one directory per cache key,
reused across engine restarts.

Layout: ``<root>/<key digest>/`` holds ``key.json`` (the key in clear, for people) and what the compiler stored
there. The torchair mode (root ``npu.torchair_cache_dir``): on an NPU torchair's ``cache_compile`` files (one
sub-directory per compiled batch-size function), on the emulated device one artifact per batch size
(:mod:`.emulated.standin`). The compiled twin (``npu.emulated_compile=inductor``, root
``<VLLM_NPU_CACHE_DIR>/emulated_compile``): one file of inductor artifacts per distinct compiled piece
(:mod:`.emulated.twin_pieces`).

The key is everything that changes what a compiled decode graph computes or how it runs:

- the model: vLLM's ``ModelConfig.compute_hash()`` (model and tokenizer path/revision, dtype, quantization,
  max_model_len, the HF config fields vLLM hashes...) plus the dtype and the KV-cache dtype/block size spelled out;
- the parallel position: TP/PP/DP sizes and this worker's TP and PP rank (collectives are inside the graph, and
  weights are this rank's shard);
- the kernels: device type (npu/emulated) and the kernel backend (``npu.kernels``);
- the torchair mode's KV caches: every cache layer's shape and dtype (``kv_cache``). The caches are static inputs
  of the decode graph, and torchair's ``cache_compile`` reloads a cached graph without Dynamo's guards or any shape
  check, so a restart whose memory profiling gives another ``num_blocks`` must not find the old graph. That is why
  the torchair mode computes its key at its first compile, after the KV caches exist (vllm-ascend v0.11.0 instead
  deletes its torchair cache at every start unless the KV-cache bytes are pinned, ``platform.py``);
- the software: vLLM, torch and torch_npu versions, CANN's version (torchair's GE graphs are built by CANN's graph
  compiler for its operator library; read from CANN's install files as ``vllm-npu doctor`` does, None without
  CANN), the plugin's distribution versions, and a digest of the plugin's installed Python sources (its versions do
  not change with every edit, the traced code does).

The batch size is part of each artifact's name inside the directory (one compiled graph per padded batch size). A
changed key is a different directory: nothing compiled for another key is ever loaded. Directories of old keys are
left in place (as torch's and vLLM's caches do); delete ``torchair_cache_dir`` to reclaim them.

Loading an artifact runs Python code that was written into the directory (pickled FX graphs, torchair's generated
code): the directory must be as trusted as the model checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Sub-directory of ``VLLM_NPU_CACHE_DIR`` used when ``npu.torchair_cache_dir`` is not set.
DEFAULT_SUBDIR = "torchair"
#: Sub-directory of ``VLLM_NPU_CACHE_DIR`` of the emulated device's compiled twin pieces (``npu.emulated_compile``).
EMULATED_COMPILE_SUBDIR = "emulated_compile"
#: Distributions whose versions enter the key (absent ones are recorded as None).
_VERSIONED = ("vllm", "torch", "torch_npu", "npu-interface", "npu-platform", "npu-ops", "npu-attention",
              "npu-quant", "npu-models", "npu-patches")  # fmt: skip


def default_cache_root(subdir: str = DEFAULT_SUBDIR) -> Path:
    """``<VLLM_NPU_CACHE_DIR>/<subdir>`` (``VLLM_NPU_CACHE_DIR`` defaults to ``$XDG_CACHE_HOME/vllm-npu``)."""
    from vllm_npu.interface import EnvConfig

    base = EnvConfig.from_environ().CACHE_DIR or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vllm-npu"
    )
    return Path(base) / subdir


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def plugin_source_digest() -> str:
    """sha256 over the installed ``vllm_npu`` Python sources (path and content, sorted by path)."""
    import vllm_npu

    digest = hashlib.sha256()
    for root in sorted(str(p) for p in vllm_npu.__path__):
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cann_version() -> str | None:
    """The installed CANN's version (its home found as the device probe finds it), or None without CANN."""
    from .._cann import find_cann

    return find_cann().version


def cache_key(
    vllm_config: VllmConfig,
    *,
    device_type: str,
    kernels: str,
    tp_rank: int,
    pp_rank: int,
    kv_cache: list[list[Any]] | None = None,
) -> dict[str, Any]:
    """The cache key of one worker (see the module docstring); JSON-serialisable. ``kv_cache``: the torchair
    mode's ``[layer name, shape, dtype]`` per KV-cache tensor (:func:`kv_cache_layout`); None leaves it out."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    key: dict[str, Any] = {
        "model": str(model.model),
        "model_config_hash": model.compute_hash(),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": cache.block_size,
        "tp_size": parallel.tensor_parallel_size,
        "pp_size": parallel.pipeline_parallel_size,
        "dp_size": parallel.data_parallel_size,
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "device_type": device_type,
        "kernels": kernels,
        "versions": {dist: _version(dist) for dist in _VERSIONED},
        "cann": cann_version(),
        "plugin_sources": plugin_source_digest(),
    }
    if kv_cache is not None:
        key["kv_cache"] = kv_cache
    return key


def kv_cache_layout(vllm_config: VllmConfig) -> list[list[Any]]:
    """``[layer name, shape, dtype]`` of every KV-cache tensor bound to the engine's layers (sorted by layer name);
    raises if no cache is bound yet (a key computed then could not tell two KV-cache sizes apart)."""
    import torch

    layout: list[list[Any]] = []
    for name, layer in sorted(vllm_config.compilation_config.static_forward_context.items()):
        for t in getattr(layer, "kv_cache", None) or ():
            if isinstance(t, torch.Tensor) and t.numel():
                layout.append([name, list(t.shape), str(t.dtype)])
    if not layout:
        raise RuntimeError(
            "the torchair compile cache key needs the KV-cache shapes, but no KV cache is bound yet: compile only "
            "after the KV caches are allocated (vLLM's capture step)"
        )
    return layout


def worker_cache(
    vllm_config: VllmConfig, root: Path, *, device_type: str, kernels: str, kv_cache: list[list[Any]] | None = None
) -> CompileCache:
    """The cache of this worker (its TP and PP rank in the key, and ``kv_cache`` when given) under ``root``."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    key = cache_key(
        vllm_config,
        device_type=device_type,
        kernels=kernels,
        tp_rank=get_tensor_model_parallel_rank(),
        pp_rank=get_pp_group().rank_in_group,
        kv_cache=kv_cache,
    )
    return CompileCache(root.expanduser().resolve(), key)


@dataclass(frozen=True)
class CompileCache:
    """The directory of one cache key (created on first use)."""

    root: Path
    key: dict[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:24]

    @property
    def directory(self) -> Path:
        return self.root / self.digest

    def prepare(self) -> Path:
        """Create the key's directory with its ``key.json``; returns the directory."""
        directory = self.directory
        directory.mkdir(parents=True, exist_ok=True)
        key_file = directory / "key.json"
        if not key_file.exists():
            tmp = key_file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.key, sort_keys=True, indent=1))
            tmp.replace(key_file)
        return directory

    def artifact(self, batch_size: int, graph_digest: str) -> Path:
        """Where the emulated stand-in keeps the graph of ``batch_size`` traced as ``graph_digest``."""
        return self.directory / f"bs{batch_size}-{graph_digest[:24]}.pt"
