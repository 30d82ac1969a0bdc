"""Expert parallelism with the all-to-all dispatcher: EP=2 over gloo in two processes vs one process.

Each rank holds different tokens and half the experts (uneven split, linear and round-robin placement, a rank with
no tokens); its output must equal the single-process MoE on its own tokens with all experts (float32, 1e-5).
Runs once with ``torch.distributed.all_to_all_single`` and once through the platform's ``NPUCommunicator``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("moe_ep_worker.py")


def _load_worker():
    spec = importlib.util.spec_from_file_location("moe_ep_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("comm", ["torch", "npu"])
def test_all_to_all_ep2_matches_single_process(tmp_path, comm):
    if comm == "npu" and importlib.util.find_spec("vllm_npu.platform.communicator") is None:
        pytest.fail("vllm_npu.platform.communicator is missing: install npu-platform")
    worker = _load_worker()
    init = f"file://{tmp_path}/pg"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_NPU_DEVICE": "emulated"}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), "2", init, str(tmp_path), comm], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        logs.append(out)
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)

    from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
    from vllm_npu.ops.moe.gating import RoutingConfig

    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(got) == set(worker.SCENARIOS)
        for name, (num_experts, tokens, routing, _) in worker.SCENARIOS.items():
            w13, w2, bias, x, logits = worker.inputs(name, rank)
            plan = build_moe_plan(RoutingConfig(**routing), num_experts, act_dtype=torch.float32, backend="reference")
            expect = moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13, w2),
                                 e_score_correction_bias=bias if routing.get("has_correction_bias") else None)
            assert got[name].shape == (tokens[rank], worker.HIDDEN)
            torch.testing.assert_close(got[name], expect, atol=1e-5, rtol=1e-5, msg=f"{name} rank {rank}")
