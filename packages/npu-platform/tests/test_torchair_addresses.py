# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The torchair mode against moved tensors and other KV-cache sizes, without an engine:

- the emulated stand-in keeps torchair's ``frozen_parameter`` rule (parameters bound to their address at compile
  time; a call over a moved parameter fails loudly, a moved buffer or KV cache is bound per call as on GE);
- the compile cache's key holds the KV caches' shapes and is computed at the first compile (after the KV caches
  exist), on the emulated path and on the NPU path (torchair's ``cache_compile`` directory)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode
from vllm_npu.platform.graphs import GraphInputMovedError, compile_cache
from vllm_npu.platform.graphs.compile_cache import CompileCache, cache_key, kv_cache_layout
from vllm_npu.platform.graphs.emulated.standin import StandInBackend
from vllm_npu.platform.graphs.torchair import TorchairStats, TorchairWrapper, forward_for


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("shift", torch.ones(4))
        self.kv_cache = [torch.zeros(3, 4)]  # read through module state, as the attention layers read theirs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.shift + self.kv_cache[0].sum(0)


def move(t: torch.Tensor) -> None:
    """Give ``t``'s storage a new address, as sleep + wake-up do (the old block is held while regrowing)."""
    storage = t.untyped_storage()
    nbytes, data = storage.nbytes(), t.detach().clone()
    before = storage.data_ptr()
    storage.resize_(0)
    blocker = torch.empty(nbytes, dtype=torch.uint8)  # takes the freed block, if the allocator would reuse it
    storage.resize_(nbytes)
    t.detach().copy_(data)
    del blocker
    assert storage.data_ptr() != before


def compiled(model, size, cache=None, stats=None):
    backend = StandInBackend(size, cache, stats or TorchairStats())
    return torch.compile(forward_for(model, size), backend=backend, fullgraph=True, dynamic=False)


@pytest.mark.parametrize("cached", [False, True], ids=["lowered", "loaded"])
def test_a_call_over_a_moved_parameter_fails_loudly(tmp_path, cached):
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 4)
    cache = CompileCache(tmp_path, {"k": 1}) if cached else None
    if cache is not None:
        cache.prepare()
        with torch.inference_mode():
            compiled(model, 2, cache)({}, x)  # writes the artifact the next compile loads
    with torch.inference_mode():
        fn = compiled(model, 2, cache)
        assert torch.equal(fn({}, x), model(x))
        move(model.proj.weight)
        with pytest.raises(GraphInputMovedError, match=r"batch size 2: frozen parameter input \d+ moved"):
            fn({}, x)
        # A fresh compile (what reset_graphs leads to) binds the new address and reads the live weights.
        assert torch.equal(compiled(model, 2, cache)({}, x), model(x))


def test_moved_buffers_and_kv_caches_are_bound_per_call_as_on_ge():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 4)
    with torch.inference_mode():
        fn = compiled(model, 2)
        fn({}, x)
        move(model.shift)
        move(model.kv_cache[0])
        model.kv_cache[0].add_(1.0)
        assert torch.equal(fn({}, x), model(x))


def layout_config(num_blocks: int, tmp_path: Path):
    layer = SimpleNamespace(kv_cache=[torch.zeros(2, num_blocks, 16, 1, 8)])
    return SimpleNamespace(
        model_config=SimpleNamespace(model="/m", dtype="torch.float32", compute_hash=lambda: "abc"),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1),
        compilation_config=SimpleNamespace(static_forward_context={"model.layers.0.self_attn.attn": layer}),
        additional_config={"npu": {"graph_mode": "torchair", "torchair_cache_dir": str(tmp_path)}},
    )


def test_the_cache_key_holds_every_kv_cache_shape(tmp_path):
    def digest(num_blocks):
        cfg = layout_config(num_blocks, tmp_path)
        key = cache_key(cfg, device_type="npu", kernels="auto", tp_rank=0, pp_rank=0, kv_cache=kv_cache_layout(cfg))
        return key, CompileCache(tmp_path, key).digest

    key, d100 = digest(100)
    assert key["kv_cache"] == [["model.layers.0.self_attn.attn", [2, 100, 16, 1, 8], "torch.float32"]]
    assert digest(100)[1] == d100 and digest(101)[1] != d100


def test_the_cache_key_refuses_to_be_computed_before_the_kv_caches_exist(tmp_path):
    cfg = layout_config(1, tmp_path)
    cfg.compilation_config.static_forward_context = {"model.layers.0.self_attn.attn": SimpleNamespace(kv_cache=[])}
    with pytest.raises(RuntimeError, match="no KV cache is bound yet"):
        kv_cache_layout(cfg)


def npu_wrapper(cfg) -> TorchairWrapper:
    wrapper = object.__new__(TorchairWrapper)
    wrapper.runnable, wrapper.runtime_mode, wrapper.device_type = Tiny(), CUDAGraphMode.FULL, "npu"
    wrapper.vllm_config, wrapper.cache = cfg, None
    wrapper.compiled, wrapper.compile_counts = {}, Counter()
    return wrapper


def test_npu_cache_compile_directory_changes_with_the_kv_cache_size(tmp_path, monkeypatch):
    """A restart whose profiling gives another num_blocks gets another torchair cache_compile directory: torchair
    reloads a cached graph without guards or shape checks."""
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    dirs: list[str] = []

    def compile_npu(fn, cache_dir):
        dirs.append(cache_dir)
        return fn

    monkeypatch.setitem(sys.modules, "vllm_npu.platform.graphs._torchair_npu", SimpleNamespace(compile_npu=compile_npu))
    monkeypatch.setattr(compile_cache, "cann_version", lambda: None)
    for num_blocks in (100, 100, 64):
        wrapper = npu_wrapper(layout_config(num_blocks, tmp_path))
        wrapper._compile(4)
        assert wrapper.cache is not None and wrapper.cache.key["kv_cache"][0][1][1] == num_blocks
    assert dirs[0] == dirs[1] != dirs[2]
    assert all(Path(d).parent == tmp_path and (Path(d) / "key.json").is_file() for d in dirs)


def test_reset_graphs_forgets_every_compiled_size_without_counting_a_recompile(tmp_path):
    wrapper = npu_wrapper(layout_config(1, tmp_path))
    wrapper.compiled = {1: print, 2: print}
    wrapper.compile_counts = Counter({1: 1, 2: 1})
    assert wrapper.reset_graphs() == 2
    assert wrapper.compiled == {} and wrapper.compile_counts == Counter()
