# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The worker's runtime extras: the profiler (both devices), ATB registration and warm-up on the NPU (stand-in
torch_npu), and stateless process groups (a real 2-rank gloo group on the emulated device, the HCCL calls against
the stand-in)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from npu_testkit.npu_runtime_standin import install_for_test
from vllm_npu.interface import DeviceMode, DeviceUnavailableError
from vllm_npu.platform import worker as worker_mod
from vllm_npu.platform._device import EmulatedDevice


def _worker(mode: DeviceMode, profiler=None):
    w = object.__new__(worker_mod.NPUWorker)
    w.device_mode = mode
    w.local_rank = 0
    w.profiler = profiler
    return w


def test_emulated_profiler_writes_a_cpu_trace(tmp_path, capsys):
    from vllm_npu.platform._profiler import build_profiler

    w = _worker(DeviceMode.EMULATED, build_profiler(str(tmp_path), emulated=True))
    w.profile(is_start=True)
    torch.ones(64, 64) @ torch.ones(64, 64)
    w.profile(is_start=False)
    traces = list(tmp_path.glob("*.pt.trace.json.gz"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert "aten::mm" in capsys.readouterr().out  # rank 0 prints the CPU-time table
    with pytest.raises(RuntimeError, match="set VLLM_TORCH_PROFILER_DIR"):
        _worker(DeviceMode.EMULATED).profile(True)


def test_npu_profiler_is_torch_npus_with_npu_activity(monkeypatch, tmp_path):
    """vllm-ascend v0.11.0's profiler (worker_v1.py:396-433), each call checked against the wheel's definitions."""
    standin = install_for_test(monkeypatch)
    from vllm_npu.platform._profiler import build_profiler

    w = _worker(DeviceMode.NPU, build_profiler(str(tmp_path), emulated=False))
    prof = standin.record["profile"][0]
    activities = standin.module.profiler.ProfilerActivity
    assert prof.kwargs["activities"] == [activities.CPU, activities.NPU]
    assert prof.kwargs["experimental_config"].kwargs["profiler_level"] == "Level1"
    assert prof.kwargs["experimental_config"].kwargs["export_type"] == "text"
    assert standin.record["trace_handler"] == [((str(tmp_path),), {})]
    w.profile(True)
    w.profile(False)
    assert prof.events == ["start", "stop"] and standin.record["traces"] == [prof]


def test_atb_registration_failure_names_the_nnal_fix(monkeypatch):
    error = OSError(2, "Please check that the nnal package is installed.")
    install_for_test(monkeypatch, atb_load_error=error)
    from vllm_npu.platform._atb import prepare_atb

    with pytest.raises(DeviceUnavailableError, match=r"could not load its ATB ops \(NNAL\).*atb/set_env.sh") as info:
        prepare_atb(torch.device("cpu"))
    assert info.value.__cause__ is error


def test_atb_registration_and_warm_up(monkeypatch):
    standin = install_for_test(monkeypatch)
    from vllm_npu.platform._atb import prepare_atb

    prepare_atb(torch.device("cpu"))
    assert standin.record["atb"] == ["register", "_npu_matmul_add_fp32"]


def test_npu_init_device_stops_at_an_nnal_problem_before_the_distributed_init(monkeypatch):
    install_for_test(monkeypatch, atb_load_error=OSError(2, "libatb.so: cannot open shared object file"))
    dist_inits = []
    monkeypatch.setattr(worker_mod, "init_worker_distributed_environment", lambda *a: dist_inits.append(a))

    # The device calls run on the CPU (the emulated backend); the worker takes the NPU path (DeviceMode.NPU).
    monkeypatch.setattr(worker_mod, "device_backend", lambda: EmulatedDevice)
    w = _worker(DeviceMode.NPU)
    w.model_config = SimpleNamespace(dtype=torch.float32, seed=None)
    with pytest.raises(DeviceUnavailableError, match="NNAL"):
        w.init_device()
    assert dist_inits == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK = """
import json, sys, torch
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
pg = stateless_init_torch_distributed_process_group("127.0.0.1", int(sys.argv[1]), int(sys.argv[2]), 2, "hccl")
x = torch.tensor([float(int(sys.argv[2]) + 1)])
pg.allreduce(x).wait()
print("RESULT", json.dumps({"sum": x.item(), "backend": pg._get_backend(torch.device("cpu")).name()}))
"""


def test_emulated_stateless_hccl_group_runs_on_gloo_across_two_processes():
    """What an RL framework calls on an Ascend host (backend="hccl"); the emulated device builds a gloo group."""
    port = _free_port()
    env = {**os.environ, "VLLM_NPU_DEVICE": "emulated", "VLLM_NO_USAGE_STATS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK, str(port), str(r)], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0
            results.append(json.loads(next(li for li in out.splitlines() if li.startswith("RESULT "))[7:]))
    finally:
        for p in procs:
            p.kill()
    assert results == [{"sum": 3.0, "backend": "gloo"}] * 2


NPU_GROUP = """
import json
from datetime import timedelta
import torch
from npu_testkit.npu_runtime_standin import install
standin = install()
from torch.distributed import HashStore, PrefixStore
from vllm_npu.platform.platform import NPUPlatform
pg = NPUPlatform.stateless_init_device_torch_dist_pg("hccl", PrefixStore("t", HashStore()), 0, 1, timedelta(seconds=42))
pg._get_backend(torch.device("npu"))  # registered for the npu device type (raises otherwise)
try:
    pg._get_backend(torch.device("cpu"))
    cpu_backend = True
except RuntimeError:
    cpu_backend = False
print("RESULT", json.dumps({
    "constructed": [{**c, "timeout": c["timeout"].total_seconds()} for c in standin.record["hccl"]],
    "calls": standin.record["hccl_calls"],
    "cpu_backend": cpu_backend,
}))
try:
    NPUPlatform.stateless_init_device_torch_dist_pg("nccl", PrefixStore("u", HashStore()), 0, 1, timedelta(seconds=1))
except Exception as e:
    print("REFUSED", type(e).__name__, e)
"""


def test_npu_stateless_group_is_process_group_hccl_as_vllm_ascend_builds_it():
    env = {**os.environ, "VLLM_NPU_DEVICE": "emulated", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run([sys.executable, "-c", NPU_GROUP], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    result = json.loads(next(li for li in lines if li.startswith("RESULT "))[7:])
    assert result == {
        "constructed": [{"rank": 0, "size": 1, "timeout": 42.0}],
        "calls": ["_set_sequence_number_for_group"],
        "cpu_backend": False,  # only the npu device type has a backend, as vllm-ascend registers it
    }
    refused = next(li for li in lines if li.startswith("REFUSED "))
    assert "ConfigError" in refused and "'nccl' is not supported on the NPU" in refused
