# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Unit tests of the torch_npu docs parser and the call checker (npu_testkit.torch_npu_docs)."""

from __future__ import annotations

import textwrap

import pytest
from npu_testkit.npu_call_scan import find_npu_call_sites, find_npu_calls
from npu_testkit.torch_npu_docs import (
    TorchNPUDocs,
    check_calls,
    load_docs,
    parse_atb_api_list,
    parse_binding_schemas,
    parse_docs_module,
    parse_meta_registrations,
    parse_registered_schemas,
    parse_signature,
)

# --- parser on hand-written examples --------------------------------------------------------------------------


def test_parse_typed_schema() -> None:
    s = parse_signature("torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)")
    assert s.name == "npu_rms_norm"
    assert [p.name for p in s.params] == ["self", "gamma", "epsilon"]
    assert [p.type for p in s.params] == ["Tensor", "Tensor", "float"]
    assert s.params[2].default == "1e-06"
    assert s.required_positional == 2
    assert s.returns == "(Tensor, Tensor)"


def test_parse_kw_only_optional_types_and_lists() -> None:
    s = parse_signature(
        "torch_npu.npu_mrope(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, *, "
        "int[]? mrope_section, str? rotary_mode='half') -> (Tensor, Tensor)"
    )
    assert [p.name for p in s.positional] == ["positions", "query", "key", "cos_sin_cache", "head_size"]
    kw = {p.name: p for p in s.params if p.kw_only}
    assert kw["mrope_section"].type == "int[]?" and kw["mrope_section"].optional
    assert kw["rotary_mode"].default == "'half'"


def test_parse_multiline_func_prefix_and_bracketed_defaults() -> None:
    s = parse_signature(
        "func: npu_x(Tensor(a!) x1, Tensor x2,\n  bool[2] output_mask=[1, 1], *, out=(a, b), int k=1) -> Tensor(a!)"
    )
    assert [p.name for p in s.params] == ["x1", "x2", "output_mask", "out", "k"]
    assert s.params[0].type == "Tensor(a!)"
    assert s.params[2].default == "[1, 1]"
    assert s.params[3].default == "(a, b)" and s.params[3].kw_only


def test_parse_untyped_and_annotated() -> None:
    s = parse_signature("torch_npu.atb.npu_op(q, k, x: List[Tensor], *, mask=None) -> Tensor")
    assert s.name == "npu_op"
    assert s.params[2].type == "List[Tensor]"
    assert s.params[3].kw_only and s.params[3].optional


def test_parse_rejects_non_signature() -> None:
    with pytest.raises(ValueError):
        parse_signature("功能描述 no schema here")
    with pytest.raises(ValueError):
        parse_signature("torch_npu.npu_op(Tensor x, ")


def test_docs_module_takes_schema_and_overloads_not_examples() -> None:
    src = textwrap.dedent('''
        def _add_torch_npu_docstr(method, docstr):
            pass

        _add_torch_npu_docstr(
            "npu_a",
            """
        torch_npu.npu_a(Tensor x, int k=1) -> Tensor
        torch_npu.npu_a(Tensor x, Tensor y, int k=1) -> Tensor
        功能描述
        >>> torch_npu.npu_a(x, bogus=1)
        torch_npu.npu_a(x, extra=extra)
        """
        )
        _add_torch_npu_docstr(
            "npu_b",
            """
        接口原型：
        func: npu_b(Tensor x,
            Tensor? y=None, *, float eps=1e-6) -> Tensor
        """
        )
        _add_torch_npu_docstr("npu_c", """only prose and >>> y = torch_npu.npu_c(x)""")
    ''')
    table = parse_docs_module(src, "_add_torch_npu_docstr", "docs")
    assert [len(s.params) for s in table["npu_a"]] == [2, 3]
    assert [p.name for p in table["npu_b"][0].params] == ["x", "y", "eps"]
    assert table["npu_c"] == []


def test_meta_registrations_only_npu_library() -> None:
    src = textwrap.dedent("""
        from torch.library import Library, impl
        m = Library("npu", "IMPL", "Meta")
        m_aten = Library("aten", "IMPL", "Meta")

        @impl(m_aten, "matmul_backward")
        def a(grad, self, other, mask):
            pass

        @impl(m, "npu_add_rms_norm")
        def b(x1, x2, gamma, epsilon=1e-6):
            pass

        if True:
            @impl(m, "npu_kw")
            def c(x, *, k=1, flag):
                pass
    """)
    meta = parse_meta_registrations(src)
    assert set(meta) == {"npu_add_rms_norm", "npu_kw"}
    (sig,) = meta["npu_add_rms_norm"]
    assert sig.required_positional == 3 and sig.params[3].default == "1e-06"
    (kw,) = meta["npu_kw"]
    assert [(p.name, p.kw_only, p.optional) for p in kw.params] == [
        ("x", False, False),
        ("k", True, True),
        ("flag", True, False),
    ]


# --- checker on examples, including wrong calls ---------------------------------------------------------------

_DOCS = TorchNPUDocs(
    ops={
        "npu_rms_norm": [parse_signature("torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06)")],
        "npu_undoc_schema": [],
        "npu_two": [parse_signature("npu_two(Tensor x) -> Tensor"), parse_signature("npu_two(Tensor x, Tensor y)")],
    },
    atb={"npu_paged": [parse_signature("torch_npu.atb.npu_paged(Tensor q, *, int heads=0, Tensor(a!) out)")]},
    meta={"npu_add_rms_norm": [parse_signature("npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6)", "meta")]},
)

_SOURCE = """
import torch_npu

def good(x, w, r, q, o, a):
    y, _ = torch_npu.npu_rms_norm(x, w, 1e-6)
    y, _ = torch_npu.npu_rms_norm(x, w, epsilon=1e-6)
    y, _, s = torch_npu.npu_add_rms_norm(x, r, w, 1e-6)
    torch_npu.atb.npu_paged(q, heads=2, out=o)
    torch_npu.npu_two(x)
    torch_npu.npu_two(x, r)
    torch_npu.npu_undoc_schema(x, anything=1)
    torch_npu.npu_rms_norm(*a)
    torch.npu.synchronize()
    torch_npu.npu.current_stream()

def bad(x, w, q):
    torch_npu.npu_rms_norm(x, w, eps=1e-6)        # line 17: wrong keyword
    torch_npu.npu_rms_norm(x, w, 1e-6, True)      # line 18: too many positionals
    torch_npu.npu_rms_norm(x)                     # line 19: gamma missing
    torch_npu.npu_not_there(x)                    # line 20: unknown op
    torch_npu.atb.npu_paged(q, heads=2)           # line 21: required kw-only out missing
    torch_npu.npu_two(x, w, w)                    # line 22: fits no overload
    torch_npu.atb.npu_rms_norm(x, w)              # line 23: wrong namespace
    torch_npu.npu_rms_norm(x, w, epsilon=1e-6, gamma=w)  # line 24: given twice
"""


def test_checker_accepts_good_and_reports_each_bad_call() -> None:
    calls = find_npu_calls(_SOURCE, "x.py")
    problems = check_calls(calls, _DOCS)
    by_line: dict[int, list[str]] = {}
    for p in problems:
        by_line.setdefault(int(p.split(":")[1]), []).append(p)
    assert sorted(by_line) == [17, 18, 19, 20, 21, 22, 23, 24], problems
    assert "keyword 'eps' is not a documented parameter" in by_line[17][0]
    assert "3 positional" not in by_line[18][0] and "4 positional arguments given, at most 3" in by_line[18][0]
    assert "required parameter(s) not given: gamma" in by_line[19][0]
    assert "npu_not_there is not in torch_npu 2.8.0" in by_line[20][0]
    assert "not given: out" in by_line[21][0]
    assert "at most" in by_line[22][0]
    assert "torch_npu.atb.npu_rms_norm is not in" in by_line[23][0]
    assert "given both positionally and by keyword" in by_line[24][0]


def test_find_calls_records_shape_of_call() -> None:
    (c,) = find_npu_calls("torch_npu.atb.op(a, b, *rest, k=1, **kw)", "f.py")
    assert (c.namespace, c.name, c.n_positional, c.keywords, c.star_args, c.star_kwargs) == (
        "atb",
        "op",
        2,
        ("k",),
        True,
        True,
    )


# --- the real torch_npu 2.8.0 wheel ---------------------------------------------------------------------------


def test_real_docs_parse_the_ops_we_use() -> None:
    docs = load_docs()
    assert len(docs.ops) > 140 and len(docs.atb) >= 9 and len(docs.meta) > 100
    (rms,) = docs.signatures("", "npu_rms_norm")
    assert rms.source == "docs" and [p.name for p in rms.params] == ["self", "gamma", "epsilon"]
    (add,) = docs.signatures("", "npu_add_rms_norm")  # documented only through its meta kernel
    assert add.source == "meta" and [p.name for p in add.params] == ["x1", "x2", "gamma", "epsilon"]
    (mrope,) = docs.signatures("", "npu_mrope")
    assert {p.name for p in mrope.params if p.kw_only} == {"mrope_section", "rotary_mode"}
    assert len(docs.signatures("atb", "npu_multi_head_latent_attention")) == 2
    multi = docs.signatures("", "npu_dequant_swiglu_quant")[0]  # a schema spread over many lines
    assert "glu_alpha" in multi.names
    # Every documented schema parses into identifiers only (a parser slip shows up as odd names).
    for table in (docs.ops, docs.atb, docs.meta):
        for sigs in table.values():
            for s in sigs:
                assert all(p.name.isidentifier() for p in s.params), s.text


def test_real_docs_report_wrong_calls() -> None:
    docs = load_docs()
    src = (
        "import torch_npu\n"
        "torch_npu.npu_rms_norm(x, w, eps=1e-6)\n"
        "torch_npu.npu_swiglu(x, -1, True)\n"
        "torch_npu.npu_add_rms_norm(x, r, w, 1e-6)\n"
        "torch_npu.npu_mrope(p, q, k, c, 64, mrope_section=[16, 24, 24], rotary_mode='half')\n"
        "torch_npu._npu_rotary_embedding(p, q, k, 64, c, True)\n"
        "torch_npu._npu_reshape_and_cache(key=k, value=v, key_cache=kc, value_cache=vc, slots=s)\n"
        "torch_npu._npu_not_an_op(x)\n"
    )
    problems = check_calls(find_npu_calls(src, "y.py"), docs)
    # line 6 is an undocumented ATB op known by its binding schema; line 7 misnames its slot_indices parameter
    assert sorted({p.split(":")[1] for p in problems}) == ["2", "3", "7", "8"], problems


def test_binding_schemas_only_api_list_default_overloads() -> None:
    ops_src = "API_LIST = [\n    '_npu_reshape_and_cache',\n    '_npu_x',\n]\nATB_API_LIST = ['npu_ring_mla']\n"
    names = parse_atb_api_list(ops_src)
    assert names == ("_npu_reshape_and_cache", "_npu_x")
    binary = (
        b"\x00junk\x00_npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        b"Tensor slot_indices) -> ()\x00_npu_x.out(Tensor a, *, Tensor(a!) out) -> Tensor(a!)\x00"
        b"npu_ring_mla(Tensor q) -> (Tensor, Tensor)\x00"
    )
    sigs = parse_binding_schemas(binary, names)
    assert list(sigs) == ["_npu_reshape_and_cache"]  # .out overloads and names outside API_LIST are skipped
    (sig,) = sigs["_npu_reshape_and_cache"]
    assert sig.source == "binding" and [p.name for p in sig.params][-1] == "slot_indices"
    docs = TorchNPUDocs(bindings=sigs)
    assert docs.check_call("", "_npu_reshape_and_cache", 5, []) == []
    assert docs.signatures("atb", "_npu_reshape_and_cache") is None  # bound as torch_npu.<name>, not torch_npu.atb


def test_registered_schemas_add_overloads_the_prose_docs_lack() -> None:
    binary = (
        b"\x00npu::npu_x.out(Tensor q, *, Tensor? workspace=None, Tensor[] out) -> (Tensor, Tensor)\x00"
        b"xnpu_x.out(Tensor bogus) -> Tensor\x00npu_x(Tensor q) -> Tensor\x00"
    )
    sigs = parse_registered_schemas(binary, ["npu_x.out"])
    (sig,) = sigs["npu_x.out"]  # the name glued to another identifier is not this op; the default overload is skipped
    assert sig.source == "registered" and [p.name for p in sig.params] == ["q", "workspace", "out"]
    docs = TorchNPUDocs(
        ops={"npu_x.out": [parse_signature("npu_x.out(Tensor q, *, Tensor(a!) attention_out) -> Tensor(a!)")]},
        registered=sigs,
    )
    assert docs.check_call("", "npu_x.out", 1, ["out", "workspace"]) == []  # fits the registered schema
    assert docs.check_call("", "npu_x.out", 1, ["attention_out"]) == []  # and still the documented one
    assert docs.check_call("", "npu_x.out", 1, ["softmax_lse"])  # neither


def test_the_fia_graph_ops_are_read_with_their_registered_schemas() -> None:
    """The MLA decode graph path's two calls, as registered in torch_npu 2.8.0's ``libtorch_npu.so``."""
    docs = load_docs()
    out_params = {p.name for s in docs.signatures("", "npu_fused_infer_attention_score.out") or [] for p in s.params}
    assert {"out", "workspace", "query_rope", "key_rope", "attention_out"} <= out_params
    (ws,) = docs.registered["_npu_fused_infer_attention_score_get_max_workspace"]
    assert {"query_rope", "key_rope", "block_table", "actual_seq_lengths_kv"} <= {p.name for p in ws.params}


def test_call_sites_carry_their_enclosing_function() -> None:
    src = textwrap.dedent(
        """
        import torch, torch_npu
        torch_npu.npu_rms_norm(x, w)
        def f(x):
            torch.npu.synchronize()
            return torch_npu.atb.npu_ring_mla(x)
        class C:
            def m(self, q):
                def inner():
                    return torch.ops.custom.npu_lightning_indexer(query=q)
                return torch_npu.npu_format_cast(q, 2), torch.ops.aten.add(q, q)
        """
    )
    got = [(s.function, s.op) for s in find_npu_call_sites(src, "z.py")]
    assert got == [
        ("", "torch_npu.npu_rms_norm"),
        ("f", "torch_npu.atb.npu_ring_mla"),
        ("C.m.inner", "torch.ops.custom.npu_lightning_indexer"),
        ("C.m", "torch_npu.npu_format_cast"),
    ]
