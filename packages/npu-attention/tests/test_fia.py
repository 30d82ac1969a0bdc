# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``ops/fia.py``: every ``npu_fused_infer_attention_score`` call of npu-attention in one module, and one argument
set for the kernel's three forms (functional, ``.out``, the maximum-workspace query), per variant.

A captured graph task re-issues ``.out`` with the workspace ``_npu_fused_infer_attention_score_get_max_workspace``
sized: the two must see the same arguments. Run against a stand-in ``torch_npu`` behind the documented 2.8.0
signatures (``npu_testkit.npu_binding_rules.documented``), which records what each form receives.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch
from npu_testkit import npu_binding_rules as rules
from npu_testkit.npu_call_scan import find_npu_call_sites
from vllm_npu.attention.ops import fia as fia_mod
from vllm_npu.attention.ops.fia import FIAArgs, fia, fia_max_workspace, fia_out

SRC = Path(fia_mod.__file__).resolve().parents[1]  # .../vllm_npu/attention


def test_the_kernel_is_called_from_fia_py_only() -> None:
    """A fix to an FIA call (its keywords, its task form) lands in one module: no other module calls it."""
    sites = [
        (path.relative_to(SRC).as_posix(), site.function, site.op)
        for path in sorted(SRC.rglob("*.py"))
        for site in find_npu_call_sites(path.read_text(encoding="utf-8"), str(path))
        if "fused_infer_attention_score" in site.op
    ]
    assert {(p, f) for p, f, _ in sites} == {
        ("ops/fia.py", "fia"),
        ("ops/fia.py", "fia_out"),
        ("ops/fia.py", "fia_max_workspace"),
    }, sites


@pytest.fixture
def recorded(monkeypatch) -> dict[str, dict]:
    calls: dict[str, dict] = {}

    def functional(query, key, value, **kw):
        calls["functional"] = {"query": query, "key": key, "value": value, **kw}
        return torch.zeros(query.shape), None

    def out(query, key, value, *, workspace=None, out, **kw):
        calls["out"] = {"query": query, "key": key, "value": value, **kw}
        calls["out_buffers"] = {"workspace": workspace, "out": out}

    def workspace(query, key, value, **kw):
        calls["workspace"] = {"query": query, "key": key, "value": value, **kw}
        return torch.empty(8, dtype=torch.uint8)

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = rules.documented(functional, name="npu_fused_infer_attention_score")
    fake.npu_fused_infer_attention_score.out = rules.documented(out, name="npu_fused_infer_attention_score.out")
    fake._npu_fused_infer_attention_score_get_max_workspace = rules.documented(
        workspace, name="_npu_fused_infer_attention_score_get_max_workspace"
    )
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return calls


def _variants() -> dict[str, FIAArgs]:
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(2, 5, 128, 2, 64, generator=g).unbind(0)
    table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    heads = {"num_heads": 8, "num_kv_heads": 2, "scale": 0.125}
    mask = torch.ones(2048, 2048, dtype=torch.int8).triu(1)
    planes = torch.randn(5, 16, 512 + 64, generator=g)
    nope, rope = planes[..., :512].unsqueeze(2), planes[..., 512:].unsqueeze(2)
    q = torch.randn(2, 32, 3, 512 + 64, generator=g)
    return {
        "gqa_paged_bsh": fia_mod.gqa_paged_bsh(
            torch.randn(2, 8, 64, generator=g),
            kc,
            vc,
            table,
            [130, 5],
            torch.zeros(2, 1, 256, dtype=torch.bool),
            **heads,
        ),  # fmt: skip
        "gqa_paged_tnd": fia_mod.gqa_paged_tnd(
            torch.randn(7, 8, 64, generator=g), kc, vc, table, [0, 4, 7], [130, 5], mask, sliding_window=16, **heads
        ),
        "latent_paged_bnsd": fia_mod.latent_paged_bnsd(
            q[:, :, :1, :512], q[:, :, :1, 512:], nope, rope, table.long(), [20, 5], 0.1
        ),
        "latent_paged_bnsd (spec)": fia_mod.latent_paged_bnsd(
            q[..., :512], q[..., 512:], nope, rope, table, [20, 5], 0.1, query_lens=[3, 2], mask=mask
        ),
    }


@pytest.mark.parametrize("variant", sorted(_variants()))
def test_the_three_forms_take_one_argument_set(recorded, variant: str) -> None:
    args = _variants()[variant]
    fia(args)
    ws = fia_max_workspace(args)
    attention_out, lse = torch.empty(args.query.shape), torch.empty(1)
    fia_out(args, out=attention_out, lse=lse, workspace=ws)

    expected = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    for form in ("functional", "out", "workspace"):
        got = recorded[form]
        assert got.keys() == expected.keys(), (form, sorted(got.keys() ^ expected.keys()))
        for name, value in expected.items():
            assert got[name] is value or got[name] == value, (form, name)
    assert recorded["out_buffers"]["workspace"] is ws
    assert [t.data_ptr() for t in recorded["out_buffers"]["out"]] == [attention_out.data_ptr(), lse.data_ptr()]


def test_variants_lay_out_the_documented_modes() -> None:
    v = _variants()
    bsh, tnd, dec, spec = v["gqa_paged_bsh"], v["gqa_paged_tnd"], v["latent_paged_bnsd"], v["latent_paged_bnsd (spec)"]
    assert (bsh.input_layout, bsh.query.shape, bsh.key.shape, bsh.actual_seq_lengths) == (
        "BSH",
        (2, 1, 512),
        (5, 128, 128),
        [1, 1],
    )
    assert bsh.sparse_mode == 0 and bsh.pre_tokens == bsh.next_tokens == fia_mod.NO_BAND
    assert (tnd.input_layout, tnd.actual_seq_lengths, tnd.sparse_mode, tnd.pre_tokens, tnd.next_tokens) == (
        "TND",
        [4, 7],
        4,
        15,
        0,
    )
    assert (dec.input_layout, dec.query.shape, dec.key.shape, dec.key_rope.shape) == (  # type: ignore[union-attr]
        "BNSD",
        (2, 32, 1, 512),
        (5, 1, 16, 512),
        (5, 1, 16, 64),
    )
    assert dec.key is dec.value and dec.block_table.dtype == torch.int32 and dec.query.is_contiguous()
    assert dec.actual_seq_lengths is None and dec.atten_mask is None and dec.sparse_mode == 0
    assert (spec.actual_seq_lengths, spec.sparse_mode, spec.query.shape) == ([3, 2], 3, (2, 32, 3, 512))


def test_the_mla_mode_refuses_undocumented_shapes() -> None:
    from vllm_npu.interface import KernelContractError

    planes = torch.zeros(3, 16, 512 + 64)
    nope, rope = planes[..., :512].unsqueeze(2), planes[..., 512:].unsqueeze(2)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(KernelContractError, match="at most 16 query tokens"):
        fia_mod.latent_paged_bnsd(torch.zeros(1, 32, 17, 512), torch.zeros(1, 32, 17, 64), nope, rope, table, [20], 1.0)
    with pytest.raises(KernelContractError, match="32/64/128 local heads"):
        fia_mod.latent_paged_bnsd(torch.zeros(1, 16, 1, 512), torch.zeros(1, 16, 1, 64), nope, rope, table, [20], 1.0)
