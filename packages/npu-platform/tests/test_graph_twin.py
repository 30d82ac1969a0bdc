# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The emulated device's static-graph twin (vllm_npu.platform.graphs.emulated.twin): replay runs the traced graph on the
captured buffers, host values are frozen at capture, moved inputs are refused, updatable tasks keep their capture
parameters until refreshed."""

from __future__ import annotations

import pytest
import torch
from vllm_npu.interface import active_recorder, launch
from vllm_npu.platform.graphs import GraphInputMovedError
from vllm_npu.platform.graphs.emulated.twin import EmulatedGraph


def test_replay_reads_the_buffers_and_writes_the_captured_output():
    x = torch.arange(4.0)
    w = torch.full((4,), 2.0)  # reached through Python state, captured by reference

    g = EmulatedGraph.capture(lambda t: t * w + 1, (x,), {})
    out = g.output
    assert torch.equal(out, x * 2 + 1)
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))  # new contents, same buffer
    w.fill_(3.0)  # in-place update of a captured tensor: seen
    result = g.replay((x,), {})
    assert result is out and torch.equal(out, torch.tensor([31.0, 61.0, 91.0, 121.0]))
    assert g.replays == 1


def test_host_values_are_frozen_at_capture():
    state = {"scale": 2.0, "lens": torch.tensor([1, 2])}

    def step(t: torch.Tensor) -> torch.Tensor:
        n = sum(state["lens"].tolist())  # host value of a non-input tensor: a constant of the graph
        return t[:n] * state["scale"]

    x = torch.ones(5)
    g = EmulatedGraph.capture(step, (x,), {})
    state["scale"], state["lens"] = 10.0, torch.tensor([2, 2])  # new Python objects: not seen by the graph
    assert torch.equal(g.replay((x,), {}), torch.full((3,), 2.0))


def test_reading_a_traced_tensor_on_the_host_fails_like_an_npu_capture():
    with pytest.raises(RuntimeError, match="get value out of a tracing tensor"):
        EmulatedGraph.capture(lambda t: t * t.sum().item(), (torch.ones(2),), {})


def test_a_moved_input_buffer_is_refused():
    x = torch.ones(3)
    g = EmulatedGraph.capture(lambda t: t + 1, (x,), {})
    with pytest.raises(GraphInputMovedError, match=r"static graph input 0 \(Tensor \(3,\)\) moved"):
        g.replay((x.clone(),), {})
    with pytest.raises(GraphInputMovedError, match="differently structured"):
        g.replay((x, x), {})


def test_keyword_calls_of_tensors_and_none_are_checked_like_any_other():
    """The model runner's call (keywords, each a tensor or None) takes a shortcut past pytree: the same checks."""
    ids, pos = torch.ones(3), torch.arange(3.0)
    g = EmulatedGraph.capture(
        lambda input_ids, positions, embeds: input_ids + positions,
        (),
        {"input_ids": ids, "positions": pos, "embeds": None},
    )
    assert g.plain == (0, ("input_ids", "positions", "embeds"), (False, False, True))
    pos.fill_(5.0)
    assert torch.equal(g.replay((), {"input_ids": ids, "positions": pos, "embeds": None}), torch.full((3,), 6.0))
    with pytest.raises(GraphInputMovedError, match=r"static graph input 1 \(Tensor \(3,\)\) moved"):
        g.replay((), {"input_ids": ids, "positions": pos.clone(), "embeds": None})
    with pytest.raises(GraphInputMovedError, match="tensors at argument leaves"):
        g.replay((), {"input_ids": ids, "positions": pos, "embeds": ids})  # None at capture: a tensor now
    with pytest.raises(GraphInputMovedError, match="differently structured"):
        g.replay((), {"positions": pos, "input_ids": ids, "embeds": None})  # another order


def _kernel(q: torch.Tensor, *, lens: list[int], out: torch.Tensor) -> None:
    out.copy_(q * torch.tensor(lens, dtype=q.dtype))


def test_tasks_keep_capture_parameters_until_refreshed():
    q, out = torch.ones(3), torch.empty(3)
    step_lens = {"now": [1, 1, 1]}

    def step(t: torch.Tensor) -> torch.Tensor:
        launch(_kernel, t, refresh=lambda: {"lens": list(step_lens["now"])}, lens=step_lens["now"], out=out)
        return out * 1

    g = EmulatedGraph.capture(step, (q,), {})
    assert g.num_tasks == 1 and torch.equal(g.output, torch.ones(3))
    step_lens["now"] = [4, 5, 6]
    assert torch.equal(g.replay((q,), {}), torch.ones(3))  # no refresh: capture-time lens
    g.refresh_tasks()
    assert torch.equal(g.replay((q,), {}), torch.tensor([4.0, 5.0, 6.0]))
    g.reset()
    assert g.num_tasks == 0


def test_launch_outside_a_capture_is_a_plain_call():
    out = torch.empty(2)
    launch(_kernel, torch.ones(2), refresh=lambda: {}, lens=[3, 4], out=out)
    assert torch.equal(out, torch.tensor([3.0, 4.0]))
    assert active_recorder() is None


@pytest.mark.parametrize("read", ["item", "tolist", "bool", "int"])
def test_every_host_read_of_a_traced_tensor_fails_the_capture(read):
    """Rule 8 of an ACL capture (torch_npu graphs.py:204-209, capture_error_mode "global"): no device-to-host read."""
    reads = {"item": lambda s: s.item(), "tolist": lambda s: s.tolist(), "bool": bool, "int": int}

    def step(t: torch.Tensor) -> torch.Tensor:
        return t * (2 if reads[read](t.sum()) else 1)

    with pytest.raises(RuntimeError, match="tracing tensor|host read while capturing"):
        EmulatedGraph.capture(step, (torch.ones(2),), {})


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.kv_cache = torch.zeros(6, 4)  # reached through Python state, as vLLM's attention layers hold theirs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kv_cache[0].copy_(x)
        return self.proj(x) + self.kv_cache.sum(0)


@pytest.mark.parametrize("move", ["resize", "rebind"])
@pytest.mark.parametrize("what", ["weight", "kv_cache"])
def test_a_replay_after_a_captured_tensor_moved_fails_naming_it(move, what):
    """A tensor captured by reference (a weight, a KV cache) whose storage moved after the capture: an NPU graph would
    read the old address (freed memory); the twin, which would silently compute with the new storage, refuses.
    ``resize_(0)`` then ``resize_(n)`` is what sleep mode does to weights and KV caches."""
    layer, x = _Layer(), torch.ones(4)
    with torch.no_grad():
        g = EmulatedGraph.capture(layer, (x,), {})
        g.replay((x,), {})  # nothing moved
        t = layer.proj.weight if what == "weight" else layer.kv_cache
        if move == "resize":
            n = t.untyped_storage().nbytes()
            t.untyped_storage().resize_(0)
            t.untyped_storage().resize_(n)
        else:
            t.data = t.data.clone()
        label = "parameter 'proj.weight'" if what == "weight" else "captured tensor"
        with pytest.raises(GraphInputMovedError, match=label):
            g.replay((x,), {})


def test_a_task_returns_nothing():
    """A task's results live in its tensor arguments: a returned tensor would be lost at replay."""

    def returning(q: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        out.copy_(q)
        return out

    out = torch.empty(2)

    def step(t: torch.Tensor) -> torch.Tensor:
        launch(returning, t, refresh=lambda: {}, out=out)
        return out + 0

    with pytest.raises(TypeError, match="graph task 'returning' returned Tensor"):
        EmulatedGraph.capture(step, (torch.ones(2),), {})
    with pytest.raises(TypeError, match="returns None"):
        launch(returning, torch.ones(2), refresh=lambda: {}, out=out)  # eager: the same contract
