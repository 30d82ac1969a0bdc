# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Dynamic EPLB with quantized experts: vLLM's rearrangement moves every per-expert tensor of npu-quant's MoE methods.

A real vLLM ``FusedMoE`` with the ``ascend`` quant config holds 6 physical slots for 4 logical experts (vLLM's initial
EPLB placement on one rank: experts 0-3, then replicas of 0 and 1), each slot loaded through the weight loader from
its logical expert's quantized tensors and processed (transposed int8 weights, flattened scales, the scales converted
for the kernel, W4A8's packed int32 weights / int64 scales / float32 scale bias, static W8A8's input scales, offsets
and quant biases). The layer runs npu-ops' MoE forward with the placement following vLLM-shaped replica tables. Then
what ``EplbState.rearrange`` does to a rank: vLLM's ``rearrange_expert_weights_inplace`` over the tensors of vLLM's
own ``FusedMoE.get_expert_weights`` (the list the model hands to ``EplbState``) to a new placement (experts moved to
other slots, other experts replicated), and the tables rewritten in place. Checked:

- the same tokens give the same output after the move, and every slot's tensors are its new logical expert's;
- dropping any one tensor from the move list changes the output (each moved tensor matters: none is stale-safe);
- npu-ops' check refuses a per-expert buffer beside the parameters (it would not move), naming it;
- vLLM builds such a layer with ``enable_eplb`` (npu-ops lets a declaring method past vLLM's FP8-only check) and
  refuses a method that does not declare;
- compiled as the torchair mode compiles it on an NPU (``dynamic=True``, ``torch_npu`` as opaque ops of the documented
  arguments): the rearrangement between steps is read without recompiling and every step equals the eager reference
  layer; a static ``npu.expert_map_path`` placement with replicas likewise (rank 0 of 2).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from npu_testkit.fake_torch_npu import fake_torch_npu
from npu_testkit.torchair_converters import (
    compile_lowered,
    fresh_dynamo_imports,
    graph_ops,
    missing_converters,
    symbolic_inputs,
)
from quant_moe_harness import TOP_K, E, G, H, build, float_experts, quantized
from vllm_npu.interface import ConfigError
from vllm_npu.ops.moe.eplb import check_expert_tensors, eplb_placement, eplb_tables
from vllm_npu.ops.moe.forward import build_moe_plan
from vllm_npu.ops.moe.gating import RoutingConfig
from vllm_npu.ops.moe.placement import ExpertPlacement
from vllm_npu.quant.tools.quantize_math import quantize_w4a8

REDUNDANT, WIDTH, TOKENS = 2, 4, 48
#: vLLM's initial placement of 4 + 2 physical experts on one rank, and the rebalanced one the test moves to: every
#: slot changes expert, and experts 2 and 3 get the replicas instead of 0 and 1.
INITIAL = [0, 1, 2, 3, 0, 1]
MOVED = [3, 2, 1, 0, 2, 3]

CASES = [
    ("W8A8_DYNAMIC", "0", torch.bfloat16),  # bfloat16 rows: the kernel takes the scales converted to bfloat16
    ("W8A8_DYNAMIC", "0", torch.float32),
    ("W4A8_DYNAMIC", "0", torch.bfloat16),
    ("W4A8_DYNAMIC", "1.0.0", torch.bfloat16),
    ("W8A8", "0", torch.float32),
]
IDS = ["w8a8_dynamic-bf16", "w8a8_dynamic-fp32", "w4a8_dynamic-bf16", "w4a8_packed-bf16", "w8a8-fp32"]


@pytest.fixture(autouse=True)
def _context(vllm_ctx: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # vLLM's rearrangement synchronizes through torch.cuda (npu-platform's model runner maps it to the device
    # backend); nothing to wait for on the host
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    with torch.no_grad():
        yield


_BUILT = itertools.count()


def _slot_tensors(qtype: str, version: str, physical: list[int]) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The checkpoint tensors of every physical slot: its logical expert's."""
    if version == "1.0.0":
        weights = float_experts()
        logical = {k: quantize_w4a8(w, G, "1.0.0", k[1] == "down_proj", torch.float32) for k, w in weights.items()}
    else:
        logical = quantized(qtype, float_experts())
    if qtype == "W8A8":
        # the harness calibrates gate/up on the same rows for every expert (one input scale and offset for all);
        # a checkpoint calibrated per expert has its own: make them differ, so a scale left behind shows
        for (e, proj), t in logical.items():
            if proj != "down_proj":
                logical[(e, proj)] = {
                    **t,
                    "input_scale": t["input_scale"] * (1 + 0.2 * e),
                    "input_offset": t["input_offset"] + e,
                }
    return {
        (p, proj): logical[(e, proj)] for p, e in enumerate(physical) for proj in ("gate_proj", "up_proj", "down_proj")
    }


def _layer(
    qtype: str,
    version: str,
    dtype: torch.dtype,
    physical: list[int],
    *,
    backend: str = "reference",
    static: ExpertPlacement | None = None,
) -> tuple[Any, Any]:
    """(processed layer whose slot p holds logical expert physical[p], its placement: vLLM's initial EPLB one on one
    rank following vLLM-shaped tables, or rank 0 of ``static``), the forward on ``backend``'s kernels."""
    prefix = f"model.layers.{next(_BUILT)}.mlp.experts"  # one vLLM config: every layer needs its own name
    layer = build(qtype, _slot_tensors(qtype, version, physical), version=version, dtype=dtype, prefix=prefix)
    placement = static
    if placement is None:
        placement = eplb_placement(E, len(physical) - E, 1)
        assert placement.physical_to_logical.tolist() == INITIAL
        table, counts = eplb_tables(physical, E, WIDTH)
        placement.follow(table, counts, torch.zeros(len(physical), dtype=torch.int32))
    layer.quant_method.process_weights_after_loading(layer)  # load-time kernels: reference (outside graphs)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("vllm_npu.interface.device.kernel_backend", lambda: backend)  # what select() sees on an NPU
        layer.moe_plan = build_moe_plan(
            RoutingConfig(top_k=TOP_K, renormalize=True),
            E,
            act_dtype=dtype,
            placement=placement,
            ep_rank=0,
            backend=backend,
        )
        layer.quant_method._build(layer)  # the forward kernels chosen on the backend (layer.moe_plan)
    return layer, placement


def _tokens(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(TOKENS, H, generator=gen).to(dtype)
    logits = torch.randn(TOKENS, E, generator=gen)
    logits[:, 2] += 1.0  # skewed, as a rebalance would see
    return x, logits.to(dtype)


def _forward(layer: Any, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return layer.quant_method.apply(layer, x, logits, TOP_K, True)


def _move_list(layer: Any) -> list[tuple[str, torch.Tensor]]:
    """vLLM's ``FusedMoE.get_expert_weights`` (what the model hands to ``EplbState``), with the names."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    views = list(FusedMoE.get_expert_weights(layer))
    names = [n for n, w in layer.named_parameters() if n != "e_score_correction_bias" and w.dim() > 0]
    assert len(names) == len(views)
    return list(zip(names, views, strict=True))


def _rearrange(layer: Any, placement: Any, moved: list[tuple[str, torch.Tensor]]) -> None:
    """What ``EplbState.rearrange`` does on this rank: vLLM's weight move, then the tables rewritten in place."""
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

    one_rank = SimpleNamespace(rank=lambda: 0, size=lambda: 1)  # every slot is on this rank: local copies only
    rearrange_expert_weights_inplace(
        torch.tensor([INITIAL]),
        torch.tensor([MOVED]),
        [[w for _, w in moved]],
        one_rank,  # type: ignore[arg-type]
    )
    table, counts = eplb_tables(MOVED, E, WIDTH)
    placement.replica_table.copy_(table)
    placement.replica_counts.copy_(counts)


@pytest.mark.parametrize(("qtype", "version", "dtype"), CASES, ids=IDS)
def test_rearranged_quantized_experts_give_the_same_output(qtype: str, version: str, dtype: torch.dtype) -> None:
    layer, placement = _layer(qtype, version, dtype, INITIAL)
    x, logits = _tokens(dtype)
    before = _forward(layer, x, logits)
    assert int(placement.load.sum()) == TOKENS * TOP_K  # the quantized experts' plan counts the load too
    moved = _move_list(layer)
    _rearrange(layer, placement, moved)
    after = _forward(layer, x, logits)
    torch.testing.assert_close(after, before, rtol=0, atol=0)

    # every moved tensor of slot p is now the one of its new logical expert (a layer loaded in that order)
    expected, _ = _layer(qtype, version, dtype, MOVED)
    reference = dict(expected.named_parameters())
    for name, _ in moved:
        torch.testing.assert_close(getattr(layer, name), reference[name], rtol=0, atol=0, msg=name)
    # and the move list is every tensor the experts read: each per-expert parameter of the processed layer
    assert {n for n, _ in moved} == {n for n, t in layer.named_parameters() if t.shape[0] == len(INITIAL)}
    check_expert_tensors(_named(layer))


@pytest.mark.parametrize(("qtype", "version", "dtype"), CASES, ids=IDS)
def test_a_tensor_left_out_of_the_move_gives_another_output(qtype: str, version: str, dtype: torch.dtype) -> None:
    built = _layer(qtype, version, dtype, INITIAL)[0]
    # every tensor the experts read (a scale the kernel reads as its converted <name>_paired copy moves too, as the
    # first test checks, but leaving it alone changes nothing: the copy is what counts)
    names = [n for n, _ in _move_list(built) if not hasattr(built, f"{n}_paired")]
    assert any(n.endswith("_paired") for n in names) == (qtype == "W8A8_DYNAMIC" and dtype == torch.bfloat16)
    x, logits = _tokens(dtype)
    for left_out in names:
        layer, placement = _layer(qtype, version, dtype, INITIAL)
        before = _forward(layer, x, logits)
        _rearrange(layer, placement, [(n, w) for n, w in _move_list(layer) if n != left_out])
        assert not torch.allclose(_forward(layer, x, logits).float(), before.float(), atol=1e-3), left_out


def _named(layer: Any) -> Any:
    assert layer.local_num_experts == len(INITIAL)  # what check_expert_tensors reads, with layer_name
    return layer


def test_a_per_expert_buffer_is_refused_naming_it() -> None:
    layer, _ = _layer("W8A8_DYNAMIC", "0", torch.bfloat16, INITIAL)
    layer = _named(layer)
    check_expert_tensors(layer)
    layer.register_buffer("w13_scale_copy", torch.ones(len(INITIAL), 4), persistent=False)
    with pytest.raises(
        ConfigError, match=r"per-expert buffer w13_scale_copy \(6, 4\).*AscendW8A8DynamicFusedMoEMethod"
    ):
        check_expert_tensors(layer)
    del layer._buffers["w13_scale_copy"]
    layer.register_parameter("shared_scale", torch.nn.Parameter(torch.ones(3), requires_grad=False))
    with pytest.raises(ConfigError, match=r"shared_scale \(3,\) is not a contiguous per-expert tensor"):
        check_expert_tensors(layer)


def _eplb_layer(prefix: str) -> Any:
    """A W8A8_DYNAMIC layer built by vLLM's FusedMoE.__init__ with ``enable_eplb`` and 2 redundant experts: npu-ops'
    layer, instantiated directly (what vLLM's FusedMoE resolves to once npu-ops registered it, which this module does
    not do: the registration is process-wide)."""
    from vllm_npu.ops.moe import AscendFusedMoE
    from vllm_npu.quant.config import AscendQuantConfig
    from vllm_npu.quant.description import QuantDescription

    desc = {
        f"{prefix}.{e}.{p}.{s}": "W8A8_DYNAMIC"
        for e in range(E)
        for p in ("gate_proj", "up_proj", "down_proj")
        for s in ("weight", "weight_scale", "weight_offset")
    }
    cfg = AscendQuantConfig(QuantDescription.from_mapping(desc))
    layer = AscendFusedMoE(
        num_experts=E,
        top_k=TOP_K,
        hidden_size=H,
        intermediate_size=32,
        params_dtype=torch.bfloat16,
        renormalize=True,
        quant_config=cfg,
        prefix=prefix,
        enable_eplb=True,
        num_redundant_experts=REDUNDANT,
    )
    assert "get_quant_method" not in vars(cfg)  # the config's own method again
    return layer


def test_vllm_builds_quantized_experts_with_eplb_and_refuses_a_method_that_does_not_declare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.11's FusedMoE refuses EPLB for every quant method but FP8 while it builds the layer; npu-ops' layer lets
    a method declaring EplbMovableExperts past that check only."""
    from vllm_npu.ops.moe import AscendFusedMoE
    from vllm_npu.quant.moe_method import AscendW8A8DynamicFusedMoEMethod

    layer = _eplb_layer(f"model.layers.{next(_BUILT)}.mlp.experts")
    assert isinstance(layer, AscendFusedMoE) and layer.enable_eplb
    assert isinstance(layer.quant_method, AscendW8A8DynamicFusedMoEMethod)
    assert layer.w13_weight.shape[0] == E + REDUNDANT and layer.expert_placement.slots == [INITIAL]
    monkeypatch.setattr(AscendW8A8DynamicFusedMoEMethod, "moves_with_eplb", False)
    with pytest.raises(NotImplementedError, match="EPLB is only supported for FP8"):
        _eplb_layer(f"model.layers.{next(_BUILT)}.mlp.experts")


# --- compiled (the torchair mode's NPU strategy) ------------------------------------------------------------------

GRAPH_CASES = [("W8A8_DYNAMIC", "0", torch.bfloat16), ("W4A8_DYNAMIC", "1.0.0", torch.bfloat16)]


def _graph_steps(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        logits = torch.randn(5, E, generator=gen)
        logits[:, 2] += 1.0
        out.append((torch.randn(5, H, generator=gen).to(dtype), logits.to(dtype)))
    return out


def _run_steps(layer: Any, placement: Any, *, compiled: bool, rearrange_at: int | None) -> tuple[list, list]:
    def forward(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return layer.quant_method.apply(layer, x, logits, TOP_K, True)

    fn, graphs = compile_lowered(forward, dynamic=True) if compiled else (forward, [])
    outs = []
    for step, (x, logits) in enumerate(_graph_steps(layer.moe_config.in_dtype)):
        if step == rearrange_at:
            _rearrange(layer, placement, _move_list(layer))
        if compiled:  # the torchair wrapper's NPU strategy: dynamic, every tensor input static
            torch._dynamo.mark_static(x)
            torch._dynamo.mark_static(logits)
        outs.append(fn(x, logits).clone())
    return outs, graphs


def _check_graph(graphs: list) -> None:
    assert len(graphs) == 1, f"{len(graphs)} compiles over four steps"
    assert symbolic_inputs(graphs[0]) == []  # the followed tables and the moved tensors are static inputs
    ops = graph_ops(graphs[0])
    assert not ops & {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default"}, ops
    assert missing_converters(ops) == [], ops
    assert not any(op.startswith("vllm_npu.") for op in ops)  # the NPU kernels, not the reference ops


@pytest.mark.parametrize(("qtype", "version", "dtype"), GRAPH_CASES, ids=["w8a8_dynamic", "w4a8_packed"])
def test_compiled_layer_reads_the_rearranged_experts_without_recompiling(
    monkeypatch: pytest.MonkeyPatch, qtype: str, version: str, dtype: torch.dtype
) -> None:
    expected, _ = _run_steps(*_layer(qtype, version, dtype, INITIAL), compiled=False, rearrange_at=2)
    unmoved, _ = _run_steps(*_layer(qtype, version, dtype, INITIAL), compiled=False, rearrange_at=None)
    layer, placement = _layer(qtype, version, dtype, INITIAL, backend="npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(quant=True))
    with fresh_dynamo_imports():
        outs, graphs = _run_steps(layer, placement, compiled=True, rearrange_at=2)
    for out, exp in zip(outs, expected, strict=True):
        # the same quantized maths; the NPU strategy's bf16 combine rounds differently from the eager reference's
        torch.testing.assert_close(out.float(), exp.float(), atol=2e-2 * float(exp.abs().max()), rtol=2e-2)
    assert torch.equal(expected[3], unmoved[3])  # the move keeps what the layer computes
    _check_graph(graphs)


@pytest.mark.parametrize(("qtype", "version", "dtype"), GRAPH_CASES, ids=["w8a8_dynamic", "w4a8_packed"])
def test_compiled_static_expert_map_with_quantized_replicas(
    monkeypatch: pytest.MonkeyPatch, qtype: str, version: str, dtype: torch.dtype
) -> None:
    """``npu.expert_map_path`` with quantized experts: rank 0 of 2 holds experts 2, 0, 3 (3 also on rank 1)."""
    slots = [[2, 0, 3], [1, 3, 0]]
    expected, _ = _run_steps(
        *_layer(qtype, version, dtype, slots[0], static=ExpertPlacement(E, slots)), compiled=False, rearrange_at=None
    )
    layer, placement = _layer(qtype, version, dtype, slots[0], backend="npu", static=ExpertPlacement(E, slots))
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(quant=True))
    with fresh_dynamo_imports():
        outs, graphs = _run_steps(layer, placement, compiled=True, rearrange_at=None)
    for out, exp in zip(outs, expected, strict=True):
        torch.testing.assert_close(out.float(), exp.float(), atol=2e-2 * float(exp.abs().max()), rtol=2e-2)
    assert any(bool(o.abs().sum() > 0) for o in outs)
    _check_graph(graphs)
