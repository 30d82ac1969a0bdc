# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUWorker.sleep / wake_up without an engine: storages released and restored, and the engine's static graphs
dropped at sleep and captured again once every tag is awake (wake-up gives the weights and KV caches new device
addresses, which graphs captured before would not see)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm_npu.interface import DeviceMode
from vllm_npu.platform import worker as worker_mod
from vllm_npu.platform._device import EmulatedDevice
from vllm_npu.platform.sleep import SleepState


class Runner:
    """The model runner surface sleep mode uses, recording the graph calls."""

    def __init__(self, graphs: int) -> None:
        self.model = torch.nn.Linear(8, 8)
        self.kv_caches = [torch.ones(4, 16)]
        self.graphs = graphs
        self.calls: list[str] = []

    def get_model(self) -> torch.nn.Module:
        return self.model

    def release_graphs(self) -> int:
        self.calls.append("release")
        released, self.graphs = self.graphs, 0
        return released

    def recapture_graphs(self) -> int:
        # Graphs must be captured over the live tensors: every storage is back at its full size by now.
        assert self.model.weight.untyped_storage().nbytes() == 8 * 8 * 4
        assert self.kv_caches[0].untyped_storage().nbytes() == 4 * 16 * 4
        self.calls.append("recapture")
        return 0

    def reload_weights(self) -> None:
        self.calls.append("reload")


def make_worker(graphs: int) -> worker_mod.NPUWorker:
    w = object.__new__(worker_mod.NPUWorker)
    w.device_mode = DeviceMode.EMULATED
    w.device = torch.device("cpu")
    w.sleep_state = SleepState()
    w.model_runner = Runner(graphs)  # type: ignore[assignment]
    w.compilation_config = SimpleNamespace(static_forward_context={})
    return w


@pytest.fixture(autouse=True)
def emulated_backend(monkeypatch):
    monkeypatch.setattr(worker_mod, "device_backend", lambda: EmulatedDevice)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_drops_the_graphs_and_wake_up_captures_them_once_everything_is_awake(level):
    w = make_worker(graphs=3)
    weight = w.model_runner.model.weight.detach().clone()
    w.sleep(level)
    assert w.model_runner.calls == ["release"]
    assert w.model_runner.model.weight.untyped_storage().nbytes() == 0
    w.wake_up(["weights"])  # RLHF-style: weights first (then updated), the KV cache later
    assert "recapture" not in w.model_runner.calls  # the KV cache is still released: no graph may be captured yet
    w.wake_up(["kv_cache"])
    assert w.model_runner.calls == ["release", *(["reload"] if level == 2 else []), "recapture"]
    if level == 1:
        assert torch.equal(w.model_runner.model.weight, weight)
    assert torch.count_nonzero(w.model_runner.kv_caches[0]) == 0  # the KV cache comes back zeroed
    w.wake_up()  # awake already: nothing to capture
    assert w.model_runner.calls.count("recapture") == 1


def test_an_engine_without_graphs_captures_nothing_after_wake_up():
    w = make_worker(graphs=0)
    w.sleep(1)
    w.wake_up()
    assert w.model_runner.calls == ["release"]
