# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Harness of the compiled-decode-graph tests (GQA and MLA, the torchair mode) without an engine.

- :func:`compiled_step` compiles an impl's forward the way the torchair wrapper compiles the model's: as a model's
  forward that reaches the impl through module attributes (under ``dynamic=True`` Dynamo keeps the impl's ints
  constant there, where it would make them symbolic inputs read from a closure); the step's graph
  inputs are the compiled function's first argument, stored in ``COMPILED_STEP`` as its first statement, and every
  graph Dynamo hands over is recorded (its forward lowered by AOTAutograd as the stand-in backend lowers it, with the
  aten graph recorded too);
- :func:`fake_torch_npu` is a ``torch_npu`` module whose graph-decode ops are opaque custom ops of the documented
  arguments (what Dynamo sees of a real torch_npu op: one node), computing the documented semantics the plain way:
  ``npu_fused_infer_attention_score`` in the two modes the graph paths call (BSH GQA, and MLA's BNSD with
  ``query_rope`` / ``key_rope``), and ``npu_scatter_nd_update_``;
- :func:`decode_step` draws a pure-decode step's ``CommonAttentionMetadata`` (what vLLM hands the metadata builders)
  with random distinct blocks and stale table rows past the step's requests;
- :func:`assert_one_npu_graph` checks what the NPU strategy must give: no compile after the first step, the lengths
  as ``SymInt`` placeholders, and GE converters for every op;
- :func:`ge_op_names` names a recorded graph's ops as torchair's converter table does
  (``npu_testkit.torchair_converters``): a fake op as the torch_npu op it stands for, the in-place
  ``npu_scatter_nd_update_`` as the functional ``npu_scatter_nd_update`` it is functionalized to (the form whose GE
  converter exists), aten ops as they are.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
from vllm_npu.interface import COMPILED_STEP

FAKE_NS = "npu_fake"  # the namespace of the fake torch_npu ops


@dataclass
class Recorded:
    """What Dynamo handed to the backend: its FX graphs, and the aten forward graphs AOTAutograd lowered them to."""

    graphs: list[torch.fx.GraphModule] = field(default_factory=list)
    aten: list[torch.fx.GraphModule] = field(default_factory=list)

    def targets(self) -> set[str]:
        return {str(n.target) for gm in self.graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")}


class _Layer(torch.nn.Module):
    """vLLM's attention layer as Dynamo meets it: a module holding the impl (a plain object) and its name."""

    def __init__(self, impl: Any, layer_name: str) -> None:
        super().__init__()
        self.impl = impl
        self.layer_name = layer_name


class _Model(torch.nn.Module):
    """The compiled model: its forward stores the graph inputs (the wrapper's first statement), then runs ``call``
    on the layer, reaching the impl through module attributes as the real model does (which decides how Dynamo
    treats the impl's ints and floats: constants, not symbolic inputs)."""

    def __init__(self, layer: _Layer, call: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.layer = layer
        self.call = call

    def forward(self, inputs: dict[str, Any], *args: torch.Tensor) -> torch.Tensor:
        COMPILED_STEP.inputs = inputs
        return self.call(self.layer, *args)


def compiled_step(
    impl: Any, layer_name: str, call: Callable[..., torch.Tensor], *, dynamic: bool
) -> tuple[Callable[..., torch.Tensor], Recorded]:
    """``run(inputs, *args)``: ``call(layer, *args)`` compiled with ``fullgraph=True`` and ``dynamic`` as the forward of
    a model whose attention layer ``layer`` (named ``layer_name``) holds ``impl``; ``inputs`` (layer name -> graph
    inputs) in ``COMPILED_STEP`` while it traces and runs (None after, as the wrapper leaves it)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    recorded = Recorded()

    def forward_compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        recorded.aten.append(gm)
        return make_boxed_func(gm.forward)

    lower = aot_autograd(fw_compiler=forward_compiler, keep_inference_input_mutations=True)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        recorded.graphs.append(gm)
        return lower(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(_Model(_Layer(impl, layer_name), call), backend=backend, fullgraph=True, dynamic=dynamic)

    def run(inputs: dict[str, Any], *args: torch.Tensor) -> torch.Tensor:
        try:
            return compiled(inputs, *args)
        finally:
            COMPILED_STEP.inputs = None

    return run, recorded


def decode_step(
    seq_lens: list[int], g: torch.Generator, *, num_blocks: int, width: int, block_size: int, batch: int
) -> CommonAttentionMetadata:
    """A decode step of ``len(seq_lens)`` single-token requests: each gets ``width`` random distinct blocks (never the
    null block 0) of a ``num_blocks`` cache, its new token's slot at position ``seq_len - 1``; the runner's persistent
    table has stale rows (block 5) past the step's requests, which padding must not read; the slot mapping is padded
    with -1 to ``batch`` tokens, as vLLM pads a graph's batch."""
    n = len(seq_lens)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(8, width, dtype=torch.int32)  # a runner's persistent table: more rows than the step's
    table[n:] = 5
    slots = []
    for b, length in enumerate(seq_lens):
        ids = perm[b * width : (b + 1) * width]
        table[b] = torch.tensor(ids, dtype=torch.int32)
        slots.append(ids[(length - 1) // block_size] * block_size + (length - 1) % block_size)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=lens.clone(),
        seq_lens_cpu=lens,
        num_computed_tokens_cpu=lens - 1,
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_table_tensor=table[:n],
        slot_mapping=torch.tensor(slots + [-1] * (batch - n), dtype=torch.int64),
        causal=True,
    )


def assert_one_npu_graph(recorded: Recorded, first_compiles: int, batch: int) -> None:
    """The NPU strategy's graph: nothing compiled after the first step (``first_compiles`` graphs: Dynamo may hand
    the first trace over twice, restarting once to specialize the float scale), the ``batch`` lengths as ``SymInt``
    placeholders, the two torch_npu decode ops in it, and a GE converter in torch_npu 2.8.0 for every op."""
    from npu_testkit.torchair_converters import missing_converters

    assert len(recorded.graphs) == first_compiles, f"{len(recorded.graphs) - first_compiles} compiles after the first"
    sym = [n for n in recorded.graphs[-1].graph.nodes if n.op == "placeholder" and "seq_lens_list" in n.name]
    assert len(sym) == batch and all(isinstance(n.meta["example_value"], torch.SymInt) for n in sym), sym
    ops = ge_op_names(recorded)
    assert {"npu.npu_fused_infer_attention_score.default", "npu.npu_scatter_nd_update.default"} <= ops, ops
    assert missing_converters(ops) == [], sorted(ops)


# --- fake torch_npu ------------------------------------------------------------------------------------------------


def _pages(cache: torch.Tensor, table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Positions ``[0, length)`` of one request from a ``[nb, bs, ...]`` cache: ``[length, ...]``."""
    pos = torch.arange(length)
    return cache[table_row[pos // block_size].long(), pos % block_size]


def _fia(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_rope: torch.Tensor | None,
    key_rope: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    actual_seq_lengths_kv: list[int],
    num_heads: int,
    num_key_value_heads: int,
    scale: float,
    input_layout: str,
) -> torch.Tensor:
    """Paged decode, one query token per request: BSH (``[B, 1, N*D]`` over ``[nb, bs, Nkv*D]``) or MLA's BNSD
    (``[B, N, 1, L]`` over one latent head ``[nb, 1, bs, L]``, plus ``q_rope . k_rope`` in the score)."""
    out = torch.empty_like(query)
    for i, length in enumerate(actual_seq_lengths_kv):
        if input_layout == "BSH":
            d = query.shape[-1] // num_heads
            q, qr = query[i, 0].view(num_heads, d), None
            k = _pages(key.view(key.shape[0], block_size, num_key_value_heads, d), block_table[i], length, block_size)
            v = _pages(
                value.view(value.shape[0], block_size, num_key_value_heads, d), block_table[i], length, block_size
            )
        else:
            assert query_rope is not None and key_rope is not None and num_key_value_heads == 1
            q, qr = query[i, :, 0], query_rope[i, :, 0]  # [N, L], [N, R]
            k = _pages(key.transpose(1, 2), block_table[i], length, block_size)  # [S, 1, L]
            v = _pages(value.transpose(1, 2), block_table[i], length, block_size)
        group = num_heads // num_key_value_heads
        for h in range(num_heads):
            score = q[h].float() @ k[:, h // group].float().T
            if qr is not None and key_rope is not None:
                score = (
                    score
                    + qr[h].float()
                    @ _pages(key_rope.transpose(1, 2), block_table[i], length, block_size)[:, 0].float().T
                )
            o = (torch.softmax(score * scale, -1) @ v[:, h // group].float()).to(out.dtype)
            if input_layout == "BSH":
                out[i, 0, h * q.shape[-1] : (h + 1) * q.shape[-1]] = o
            else:
                out[i, h, 0] = o
    return out


def _register() -> tuple[Any, Any]:
    try:
        ops = getattr(torch.ops, FAKE_NS)
        return ops.npu_fused_infer_attention_score, ops.npu_scatter_nd_update_
    except (AttributeError, RuntimeError):
        pass
    fia = torch.library.custom_op(f"{FAKE_NS}::npu_fused_infer_attention_score", mutates_args=())(_fia)
    fia.register_fake(lambda query, *rest: torch.empty_like(query))

    def scatter(input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> None:
        input[tuple(indices.unbind(-1))] = updates

    torch.library.custom_op(f"{FAKE_NS}::npu_scatter_nd_update_", mutates_args=("input",))(scatter)
    ops = getattr(torch.ops, FAKE_NS)
    return ops.npu_fused_infer_attention_score, ops.npu_scatter_nd_update_


#: The keywords of npu_fused_infer_attention_score the graph paths may pass (torch_npu 2.8.0 documents them all;
#: tests/contract checks the real calls against the docs): the fake refuses any other, and modes it does not compute.
_FIA_KEYWORDS = {
    "query_rope", "key_rope", "atten_mask", "block_table", "block_size", "input_layout", "actual_seq_lengths",
    "actual_seq_lengths_kv", "num_key_value_heads", "num_heads", "scale", "sparse_mode", "pre_tokens", "next_tokens",
    "antiquant_scale", "antiquant_mode",
}  # fmt: skip


def fake_torch_npu() -> types.ModuleType:
    """A ``torch_npu`` module (Dynamo traces the twins' ``import torch_npu``) with the two graph-decode ops."""
    fia, scatter = _register()

    def npu_fused_infer_attention_score(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> Any:
        assert set(kw) <= _FIA_KEYWORDS, sorted(set(kw) - _FIA_KEYWORDS)
        assert kw.get("atten_mask") is None and kw.get("sparse_mode", 0) == 0, "a mask / sparse mode not faked"
        assert kw.get("antiquant_scale") is None and kw.get("antiquant_mode", 0) == 0, "no int8 cache in graphs"
        assert kw.get("pre_tokens", 2147483647) == kw.get("next_tokens", 2147483647) == 2147483647, "no band"
        layout = kw["input_layout"]
        assert layout in ("BSH", "BNSD") and query.shape[1 if layout == "BSH" else 2] == 1, "Q_S = 1"
        if kw.get("actual_seq_lengths") is not None:
            assert list(kw["actual_seq_lengths"]) == [1] * query.shape[0]
        out = fia(
            query, key, value, kw.get("query_rope"), kw.get("key_rope"), kw["block_table"], kw["block_size"],
            kw["actual_seq_lengths_kv"], kw["num_heads"], kw["num_key_value_heads"], kw["scale"], layout,
        )  # fmt: skip
        return out, None

    def npu_scatter_nd_update_(input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        scatter(input, indices, updates)
        return input

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = npu_fused_infer_attention_score  # type: ignore[attr-defined]
    fake.npu_scatter_nd_update_ = npu_scatter_nd_update_  # type: ignore[attr-defined]
    return fake


def ge_op_names(recorded: Recorded) -> set[str]:
    """The ops GE would have to convert, named as in torchair's converter table (see the module docstring): the fake
    torch_npu ops of Dynamo's graphs and the aten ops of the lowered graphs."""
    names = set()
    for target in recorded.targets():
        if target.startswith(f"{FAKE_NS}."):
            op = target.split(".")[1]
            names.add(f"npu.{op.removesuffix('_')}.default")  # the in-place op's functional form
    for gm in recorded.aten:
        for n in gm.graph.nodes:
            target = n.target
            if n.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
                names.add(f"aten.{target._opname}.{target._overloadname}")
    return names
