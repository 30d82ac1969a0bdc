# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The GQA decode kernels captured as ACL graph tasks, against the stand-in torch_npu (``test_npu_dispatch``'s ops)
and the stand-in ``torch.npu`` graph runtime (:mod:`npu_testkit.fake_npu_graphs`), which refuses an allocation
inside a task group or update, and a host read while capturing.

- the sliding-window decode: the mask, the softmax LSE buffer and the maximum workspace are made before the task;
  the group holds ``npu_fused_infer_attention_score.out`` alone (torch_npu ``npu/graphs.py:137-160``);
- the plain decode (``_npu_paged_attention_v2``) gets a workspace sized for the step's lengths at capture and before
  every update (vllm-ascend v0.11.0 ``compilation/acl_graph.py:279-299``);
- padding slots reach the captured KV write as the null slot 0, never -1 (vllm-ascend ``model_runner_v1.py:1506``).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from attn_harness import TOLERANCES, dense_reference, make_batch, make_builder
from npu_testkit import fake_npu_graphs
from test_npu_dispatch import CALLS, fake_npu  # noqa: F401  (the stand-in torch_npu fixture)
from vllm_npu.attention.backends.gqa import AscendAttentionImpl

H, HKV, D, BS = 8, 2, 64, 128


@pytest.fixture
def graph_npu(fake_npu, monkeypatch):  # noqa: F811
    from vllm_npu.platform.graphs import _npu

    monkeypatch.setattr(_npu, "_UPDATE_STREAM", [], raising=False)
    return fake_npu_graphs.install(monkeypatch, torch_npu=sys.modules["torch_npu"])


def _decode(ctx_lens: list[int], window: int | None, seed: int = 3):
    batch = make_batch(
        [1] * len(ctx_lens), ctx_lens, num_heads=H, num_kv_heads=HKV, head_size=D, block_size=BS,
        dtype=torch.float16, num_pad=0, seed=seed,
    )  # fmt: skip
    md = make_builder(BS, HKV, D, torch.float16).build(0, batch.common)
    impl = AscendAttentionImpl(H, D, D**-0.5, HKV, None, window, "auto", None, "decoder")
    return batch, md, impl


def _capture(batch, md, impl, monkeypatch):
    from vllm_npu.platform.graphs._npu import NPUGraph

    layer = types.SimpleNamespace(layer_name="layer.0")
    metadata = {"layer.0": md}
    monkeypatch.setattr(
        "vllm.forward_context.get_forward_context", lambda: types.SimpleNamespace(attn_metadata=metadata)
    )
    output = torch.zeros_like(batch.query)

    def step(query: torch.Tensor) -> torch.Tensor:
        return impl.forward(layer, query, batch.key, batch.value, batch.kv_cache, md, output=output)

    return NPUGraph.capture(step, (batch.query,), {}, None, None), output, metadata


def test_window_decode_task_group_holds_the_out_kernel_alone(graph_npu, monkeypatch):
    batch, md, impl = _decode([4, 127, 128, 300], window=6)
    g, output, _ = _capture(batch, md, impl, monkeypatch)
    expected = dense_reference(batch, num_heads=H, num_kv_heads=HKV, head_size=D, sliding_window=6)
    torch.testing.assert_close(output.double(), expected, **TOLERANCES[torch.float16])
    assert g.num_tasks == 1 and CALLS.count("get_max_workspace") == 1
    task = g.tasks[0]
    assert {"mask", "lse", "workspace"} <= set(task.params)
    # an update changes the host lengths only: no allocation inside it (the stand-in refuses one), no new workspace
    output.zero_()
    g.refresh_tasks()
    torch.testing.assert_close(output.double(), expected, **TOLERANCES[torch.float16])
    assert CALLS.count("get_max_workspace") == 1


def test_decode_task_gets_a_workspace_for_its_lengths_at_capture_and_every_update(graph_npu, monkeypatch):
    batch, md, impl = _decode([4, 127, 128, 300], window=None)
    g, output, metadata = _capture(batch, md, impl, monkeypatch)
    assert CALLS[-2:] == ["_npu_paged_attention_v2_get_workspace[5, 128, 129, 301]", "_npu_paged_attention_v2"]
    captured = g.tasks[0].params["workspace"]
    assert isinstance(captured, torch.Tensor) and captured.numel() == 64
    # the next step: the same requests one token longer (the KV of the new token is not needed to check the plumbing)
    longer, md2, _ = _decode([5, 128, 129, 301], window=None)
    metadata["layer.0"] = md2
    CALLS.clear()
    g.refresh_tasks()
    assert CALLS == ["_npu_paged_attention_v2_get_workspace[6, 129, 130, 302]", "_npu_paged_attention_v2"]


def test_padding_slots_reach_the_npu_kv_write_as_the_null_slot(fake_npu):  # noqa: F811
    """vLLM fills the slots past the real tokens with -1 for full graphs; the NPU metadata carries 0 (null block)."""
    batch = make_batch(
        [1, 1, 1], [4, 9, 130], num_heads=H, num_kv_heads=HKV, head_size=D, block_size=BS, dtype=torch.float16,
        num_pad=5, seed=1,
    )  # fmt: skip
    md = make_builder(BS, HKV, D, torch.float16).build(0, batch.common)
    slots = batch.common.slot_mapping
    assert bool((slots[3:] == -1).all())
    assert torch.equal(md.slot_mapping[:3], slots[:3]) and bool((md.slot_mapping[3:] == 0).all())
