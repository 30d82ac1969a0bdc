# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Pangu Pro MoE on the emulated Ascend 310P (``VLLM_NPU_EMULATED_SOC=310P``): tensor_parallel_size=2 with expert
parallelism over two spawned workers, float16, the deployment vllm-ascend v0.11.0's 310P e2e suite runs (TP4 + EP,
``tests/e2e/310p/test_offline_inference_parallel_310p.py``) at the size of the tiny model. One engine.

Each rank owns one MoGE group whole; the MoE takes the 310P paths (torch gate, the torch token permutation of
vllm-ascend's MoGE dispatcher, ``npu_grouped_matmul`` + ``npu_swiglu`` in float32, torch combine) and the attention
the NZ paths. Reference: the float64 implementation in ``pangu_moe_reference.py`` (there is no HF Pangu class),
greedy, on prompts whose reference top-1/top-2 margins stay clear of float16 noise.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
from npu_testkit.engine import ep2_engine, greedy, make_prompts, patched_environ
from npu_testkit.pangu import build_tiny_pangu, load_tensors
from vllm_npu.interface import reset_chip

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from pangu_moe_reference import PanguReference  # noqa: E402

pytestmark = pytest.mark.engine

# collective_rpc pickles the probes for the spawned workers, which cannot import this test module by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOC = {"VLLM_NPU_EMULATED_SOC": "310P"}
MAX_TOKENS = 10
PROMPTS = make_prompts([1, 6, 17, 70], seed=3)  # 70 tokens: chunked by the 64-token step budget


@pytest.fixture(scope="module")
def tiny_pangu():
    return build_tiny_pangu()


@pytest.fixture(scope="module")
def llm(tiny_pangu, tmp_path_factory):
    with patched_environ(SOC):
        reset_chip()
        try:
            with ep2_engine(tiny_pangu, tmp_path_factory.mktemp("p310_pangu"), dtype="float16") as llm:
                yield llm
        finally:
            reset_chip()
    reset_chip()


def _moe_paths(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm_npu.interface import current_chip

    model = worker.model_runner.get_model()
    layers = []
    for m in model.modules():
        if isinstance(m, FusedMoE):
            plan, experts = m.moe_plan, m.moe_plan.unquantized_experts(m.w13_weight, m.w2_weight)
            layers.append(
                (
                    m.ep_rank,
                    m.expert_map.tolist(),
                    str(m.w13_weight.dtype),
                    type(plan.dispatcher).__name__,
                    plan.gate_path,
                    plan.dispatcher.init_routing.__name__,
                    experts.activation.__name__,
                )
            )
    return current_chip(), layers


def test_each_rank_takes_the_310p_moe_paths(llm):
    per_rank = llm.collective_rpc(_moe_paths)
    maps = {0: [0, 1, 2, 3, -1, -1, -1, -1], 1: [-1, -1, -1, -1, 0, 1, 2, 3]}
    assert len(per_rank) == 2
    for soc, layers in per_rank:
        assert soc == "310P" and len(layers) == 2
        for rank, expert_map, dtype, dispatcher, gate, routing, activation in layers:
            assert expert_map == maps[rank] and dtype == "torch.float16"
            # Experts split over ranks holding the same tokens: the combine is combine_masked (torch) on every chip.
            assert (dispatcher, gate, routing) == ("LocalDispatcher", "native", "init_routing_310p_reference")
            assert activation == "swiglu_reference"  # SWIGLU_310P's twin (its NPU side runs npu_swiglu in float32)
    assert sorted(layers[0][0] for _, layers in per_rank) == [0, 1]


def _record_collectives(worker):
    """Wrap ``torch.distributed.broadcast`` / ``all_reduce`` in this worker to record (op, dtype, group kind)."""
    import inspect

    import torch.distributed as dist
    from vllm.distributed import parallel_state

    def kind(group):
        coordinators = [ref() for ref in parallel_state._groups.values()]
        if any(c is not None and group is c.cpu_group for c in coordinators):
            return "cpu"
        return "device"  # a coordinator's device group, or the default (world) group: HCCL on an NPU

    def wrap(name, fn):
        signature = inspect.signature(fn)

        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            worker._p310_collectives.add((name, str(bound["tensor"].dtype), kind(bound.get("group"))))
            return fn(*args, **kwargs)

        recorded._p310_wrapped = fn
        return recorded

    worker._p310_collectives = set()
    for name in ("broadcast", "all_reduce"):
        fn = getattr(dist, name)
        setattr(dist, name, wrap(name, getattr(fn, "_p310_wrapped", fn)))


def _recorded_collectives(worker):
    return sorted(worker._p310_collectives)


def test_tp2_ep_float16_greedy_matches_the_float64_reference(llm, tiny_pangu):
    reference = PanguReference(*load_tensors(tiny_pangu))
    expected, gaps = zip(*(reference.greedy(p, MAX_TOKENS) for p in PROMPTS))
    assert min(gaps) > 0.02, f"a reference near-tie ({min(gaps):.4f}): pick other prompts"
    llm.collective_rpc(_record_collectives)
    assert greedy(llm, PROMPTS, MAX_TOKENS) == list(expected)
    # What vllm-ascend v0.11.0 replaces on a 310P (patch_distributed.py: broadcast of device tensors, int64
    # all_reduce) is never sent to a device group while serving TP + EP: the TP all-reduces are float16 activations.
    for recorded in llm.collective_rpc(_recorded_collectives):
        device = [(op, dtype) for op, dtype, kind in recorded if kind == "device"]
        assert ("all_reduce", "torch.float16") in device
        assert not [c for c in device if c[0] == "broadcast" or c[1] == "torch.int64"], recorded
