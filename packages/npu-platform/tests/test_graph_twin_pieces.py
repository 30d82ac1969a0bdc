# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The compiled twin's pure pieces (vllm_npu.platform.graphs.emulated.twin_pieces): the per-layer views of captured buffers
move to their first use so a layer's pure nodes form one piece, same-shape layers share one compile, and the
on-disk cache of compiled pieces hits for the same key in a fresh inductor cache and misses for another key, with
outputs equal to the uncompiled graph's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
from torch.fx.experimental.proxy_tensor import make_fx
from vllm_npu.interface import launch
from vllm_npu.platform.graphs.compile_cache import CompileCache
from vllm_npu.platform.graphs.emulated import twin_pieces
from vllm_npu.platform.graphs.emulated.twin import EmulatedGraph
from vllm_npu.platform.graphs.wrapper import PieceStats

LAYERS = 3


def _attend(q: torch.Tensor, cache: torch.Tensor, *, lens: list[int], out: torch.Tensor) -> None:
    for i, n in enumerate(lens):
        out[i].copy_(q[i] * cache[:n].sum(dim=0))


class _Layers:
    """Decoder-like layers of equal shapes, each: a view of its own cache (traced first, as vLLM's layers unbind
    their KV cache before projecting), a pure projection, a cache write, a task reading the cache, a pure tail."""

    def __init__(self) -> None:
        self.w = [torch.linspace(-1.0 + i, 1.0 + i, 16).reshape(4, 4) / 4 for i in range(LAYERS)]
        self.kv = [torch.zeros(2, 8, 4) for _ in range(LAYERS)]
        self.out = [torch.empty(2, 4) for _ in range(LAYERS)]
        self.lens = [1, 1]

    def __call__(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(LAYERS):
            key, _ = self.kv[i].unbind(0)
            h = torch.relu(h @ self.w[i]) + 1.0
            key.view(-1, 4).index_copy_(0, slots, h)
            launch(_attend, h, key, refresh=lambda: {"lens": list(self.lens)}, lens=self.lens, out=self.out[i])
            h = torch.tanh(self.out[i] * 0.1) + h
        return h


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> PieceStats:
    """Empty in-process memo of compiled pieces and fresh counters."""
    monkeypatch.setattr(twin_pieces, "_COMPILED", {})
    stats = PieceStats()
    monkeypatch.setattr(twin_pieces, "PIECE_STATS", stats)
    return stats


def _capture() -> tuple[EmulatedGraph, _Layers, torch.Tensor, torch.Tensor]:
    step, x, slots = _Layers(), torch.ones(2, 4), torch.tensor([0, 1])
    return EmulatedGraph.capture(step, (x, slots), {}), step, x, slots


def test_layers_form_one_piece_each_and_equal_layers_share_one_compile(fresh):
    plain, s1, x1, sl1 = _capture()
    compiled, s2, x2, sl2 = _capture()
    compiled.compile()
    # pure pieces: layer 0's projection, (tail of i + projection of i+1) twice, the last tail; the two middle
    # pieces are the same computation on other weights: one compile
    assert fresh.pieces == LAYERS + 1 and fresh.compiles == LAYERS and fresh.shared == 1
    for values, slots in (([0.5, -1.0], [2, 3]), ([2.0, 3.0], [4, 5])):
        for g, step, x, sl in ((plain, s1, x1, sl1), (compiled, s2, x2, sl2)):
            x.copy_(torch.tensor(values).unsqueeze(1).expand(2, 4))
            sl.copy_(torch.tensor(slots))
            step.lens = [slots[1] + 1, slots[1] + 1]
            g.refresh_tasks()
            g.replay((x, sl), {})
        torch.testing.assert_close(compiled.output, plain.output)
        for k1, k2 in zip(s1.kv, s2.kv, strict=True):
            torch.testing.assert_close(k2, k1)  # every layer's cache written in place, as uncompiled
    plain.reset()
    compiled.reset()


def _piece(scale: float) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.nn.functional.silu(x @ w) * scale
        return y, y.sum(-1)

    inputs = [torch.linspace(-2, 2, 24).reshape(3, 8), torch.linspace(-1, 1, 64).reshape(8, 8)]
    return make_fx(f)(*inputs), inputs


def test_disk_cache_hits_in_a_fresh_inductor_cache_and_misses_for_another_key(fresh, tmp_path: Path):
    piece, inputs = _piece(0.5)
    expected = piece(*inputs)
    cache = CompileCache(tmp_path / "twin", {"model": "a"})
    with temporary_cache_dir(str(tmp_path / "inductor-1")):
        first = twin_pieces.compile_piece(piece, inputs, cache)
    assert (fresh.compiles, fresh.disk_writes, fresh.disk_hits) == (1, 1, 0)
    assert len(list(cache.directory.glob("twin-*.bin"))) == 1 and (cache.directory / "key.json").exists()
    torch.testing.assert_close(first(*inputs), expected)

    twin_pieces._COMPILED.clear()  # as a new process: nothing compiled in memory, an empty inductor cache
    with temporary_cache_dir(str(tmp_path / "inductor-2")):
        loaded = twin_pieces.compile_piece(piece, inputs, cache)
    assert (fresh.compiles, fresh.disk_writes, fresh.disk_hits) == (2, 1, 1)
    torch.testing.assert_close(loaded(*inputs), expected)

    twin_pieces._COMPILED.clear()
    other = CompileCache(tmp_path / "twin", {"model": "b"})  # a changed key: another directory, nothing loaded
    with temporary_cache_dir(str(tmp_path / "inductor-2")):
        again = twin_pieces.compile_piece(piece, inputs, other)
    assert (fresh.compiles, fresh.disk_writes, fresh.disk_hits) == (3, 2, 1)
    assert other.directory != cache.directory and len(list(other.directory.glob("twin-*.bin"))) == 1
    torch.testing.assert_close(again(*inputs), expected)


def test_a_different_computation_is_not_shared(fresh):
    half, inputs = _piece(0.5)
    double, _ = _piece(2.0)
    a = twin_pieces.compile_piece(half, inputs)
    b = twin_pieces.compile_piece(double, inputs)
    assert fresh.compiles == 2 and fresh.shared == 0
    torch.testing.assert_close(b(*inputs)[0], 4 * a(*inputs)[0])
    c = twin_pieces.compile_piece(_piece(0.5)[0], inputs)  # traced again: the same code, one compile
    assert fresh.compiles == 2 and fresh.shared == 1
    torch.testing.assert_close(c(*inputs), half(*inputs))


def test_a_task_with_nested_tensor_arguments_runs_through_pytree():
    """Captured tasks whose positional arguments are flat take a fast path; nested ones keep the general one."""

    def add_all(pair: list[torch.Tensor], *, out: torch.Tensor) -> None:
        out.copy_(pair[0] + pair[1])

    out = torch.zeros(3)

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        launch(add_all, [a * 2, b], refresh=lambda: {}, out=out)
        return out + 0

    a, b = torch.ones(3), torch.arange(3.0)
    g = EmulatedGraph.capture(step, (a, b), {})
    a.fill_(3.0)
    g.replay((a, b), {})
    torch.testing.assert_close(g.output, torch.tensor([6.0, 7.0, 8.0]))
    g.reset()


def test_in_place_ops_on_intermediates_compile_where_ci_is_set(fresh, monkeypatch: pytest.MonkeyPatch):
    """The RMSNorm twin's shape: ``rsqrt_`` on an intermediate. compile_fx_inner skips AOTAutograd, so the piece is
    functionalized when re-traced; left in place, inductor would lower ``rsqrt_`` as an implicit fallback, which it
    refuses wherever ``CI`` is set (an op with a decomposition), as on the CI machine."""
    monkeypatch.setenv("CI", "true")

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True).add_(1e-6)
        return x * var.rsqrt_() * w

    inputs = [torch.linspace(-2, 2, 24).reshape(3, 8), torch.linspace(0.5, 1.5, 8)]
    piece = make_fx(norm)(*inputs)
    assert any(n.target is torch.ops.aten.rsqrt_.default for n in piece.graph.nodes)
    decomposed = twin_pieces._decomposed(piece, inputs)
    assert not any(n.target is torch.ops.aten.rsqrt_.default for n in decomposed.graph.nodes)
    compiled = twin_pieces.compile_piece(piece, inputs)
    torch.testing.assert_close(compiled(*inputs), norm(*inputs))


def test_a_warm_start_loads_the_stored_code_without_retracing_or_inductor(
    fresh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The second process of a key loads each piece's generated code by the piece's structure key: no re-trace with
    inductor's decompositions, no inductor compile or FX-graph cache lookup (the warm start's cost before)."""
    piece, inputs = _piece(0.5)
    expected = piece(*inputs)
    cache = CompileCache(tmp_path / "twin", {"model": "a"})
    with temporary_cache_dir(str(tmp_path / "inductor-1")):
        twin_pieces.compile_piece(piece, inputs, cache)
    assert len(list(cache.directory.glob("twin-code-*.py"))) == 1

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a warm start re-traced or compiled a stored piece")

    twin_pieces._COMPILED.clear()  # as a new process
    monkeypatch.setattr(twin_pieces, "_decomposed", refused)
    monkeypatch.setattr(twin_pieces, "_inductor", refused)
    with temporary_cache_dir(str(tmp_path / "inductor-1")):
        loaded = twin_pieces.compile_piece(make_fx(lambda x, w: piece(x, w))(*inputs), inputs, cache)  # traced anew
    assert (fresh.compiles, fresh.disk_hits) == (2, 1)
    torch.testing.assert_close(loaded(*inputs), expected)


def test_the_structure_key_ignores_names_and_sees_values(fresh):
    """Equal computations traced under other names share a key; another constant or input shape does not."""
    half, inputs = _piece(0.5)
    renamed, _ = _piece(0.5)
    for node in renamed.graph.nodes:
        if node.op not in ("placeholder", "output"):
            node.name = f"layer_7_{node.name}"
    renamed.recompile()
    key = twin_pieces.structure_key(half, inputs)
    assert key is not None and twin_pieces.structure_key(renamed, inputs) == key
    assert twin_pieces.structure_key(_piece(2.0)[0], inputs) != key
    wider = [torch.ones(4, 8), inputs[1]]
    assert twin_pieces.structure_key(make_fx(lambda x, w: half(x, w))(*wider), wider) != key
