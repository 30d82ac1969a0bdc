# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""torch_npu 2.8.0's documented op signatures, read from the wheel without importing torch_npu.

Importing torch_npu on a host without CANN breaks ``import torch``, so this module only downloads the wheel once
(``pip download --no-deps``), opens it as a zip and parses three files:

- ``torch_npu/_op_plugin_docs.py``: ``_add_torch_npu_docstr("<name>", <doc string>)`` calls whose doc usually starts
  with a schema line such as ``torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor,
  Tensor)``. Some schemas span several lines, some drop the ``torch_npu.`` prefix or carry ``func:``, some only
  give bare names (``npu_iou(bboxes, gtboxes, mode=0)``), and a few docs give no schema at all.
- ``torch_npu/op_plugin/atb/_atb_api_docs.py``: the same for ``torch_npu.atb.<name>``, where several overloads may
  be listed on consecutive lines.
- ``torch_npu/op_plugin/meta/_meta_registrations.py``: ``@impl(m, "<name>") def f(...)`` meta kernels; their Python
  parameter lists are the only written contract of ops the docs leave out (``npu_add_rms_norm``,
  ``npu_apply_rotary_pos_emb``, ...).
- ``torch_npu/lib/libtorch_npu.so``'s registered schema strings of :data:`REGISTERED_SCHEMA_OPS`, ops whose
  prose docs disagree with the schema they are registered with (both count as documented).
- the ATB bindings the docs leave out: ``torch_npu/op_plugin/atb/_atb_ops.py`` binds every name of its ``API_LIST``
  (``_npu_reshape_and_cache``, ``_npu_paged_attention``, ...) as ``torch_npu.<name>``, and
  ``torch_npu/lib/libop_plugin_atb.so`` holds the ``TORCH_LIBRARY`` schema strings those ops are registered with
  (``_npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, ...) -> ()``). Only names of
  ``API_LIST`` are taken from there, and only when the docs and the meta registrations have no schema for them.

:func:`load_docs` returns a :class:`TorchNPUDocs` whose :meth:`TorchNPUDocs.check_call` says what is wrong with a
call (unknown op, undocumented keyword, bad positional arity, missing required argument).

The wheel is cached under ``$NPU_TESTKIT_CACHE`` (default ``~/.cache/vllm-npu-tests``); a wheel already on disk can
be named with ``NPU_TESTKIT_TORCH_NPU_WHEEL``.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .npu_call_scan import NPUCall

TORCH_NPU_VERSION = "2.8.0"
OP_DOCS_PATH = "torch_npu/_op_plugin_docs.py"
ATB_DOCS_PATH = "torch_npu/op_plugin/atb/_atb_api_docs.py"
META_PATH = "torch_npu/op_plugin/meta/_meta_registrations.py"
ATB_OPS_PATH = "torch_npu/op_plugin/atb/_atb_ops.py"
ATB_LIB_PATH = "torch_npu/lib/libop_plugin_atb.so"
TORCH_NPU_LIB_PATH = "torch_npu/lib/libtorch_npu.so"
#: Ops whose prose docs disagree with the schema they are registered with (``libtorch_npu.so``); a call fits either.
#: ``.out``: the docs name its outputs ``attention_out, softmax_lse``, the registered schema takes ``Tensor[] out``
#: (as the docs' own example and torch_npu's ``npu/graphs.py`` call it); the workspace query: the docs omit
#: ``query_rope`` / ``key_rope``, the registered schema has them, like the op itself.
REGISTERED_SCHEMA_OPS = ("npu_fused_infer_attention_score.out", "_npu_fused_infer_attention_score_get_max_workspace")
#: ATB ops (``torch_npu.atb.<name>``, bound to ``torch.ops.atb.<name>`` by ``_atb_ops.py``) whose docs leave out a
#: parameter of the schema they are registered with (``libop_plugin_atb.so``); call name -> the overload a call
#: binds to. ``_npu_paged_attention_v2`` is registered only as ``.out``, whose schema ends in ``Tensor? workspace=None,
#: Tensor(a!) out``: the docs omit ``workspace``. Its workspace query ``_npu_paged_attention_v2_get_workspace`` is in
#: ``ATB_API_LIST`` but has no docs entry at all. A call fits the docs or the registered schema.
REGISTERED_ATB_SCHEMA_OPS = {
    "_npu_paged_attention_v2": "_npu_paged_attention_v2.out",
    "_npu_paged_attention_v2_get_workspace": "_npu_paged_attention_v2_get_workspace",
}

# torch_npu 2.8.0 is built on manylinux_2_28; older tags are tried too so the code survives a re-tagged upload.
_PLATFORMS = {
    "x86_64": ("manylinux_2_28_x86_64", "manylinux2014_x86_64"),
    "aarch64": ("manylinux_2_28_aarch64", "manylinux2014_aarch64"),
}

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class DocsUnavailableError(RuntimeError):
    """The torch_npu wheel could not be found or downloaded."""


# --- signatures -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One documented parameter. ``type`` is the schema type (``Tensor?``, ``int[]?``...) or None when untyped."""

    name: str
    type: str | None = None
    default: str | None = None
    kw_only: bool = False

    @property
    def optional(self) -> bool:
        """Whether a call may leave it out: it has a default, or its schema type is Optional (``Tensor?``)."""
        return self.default is not None or (self.type is not None and self.type.rstrip().endswith("?"))


@dataclass(frozen=True)
class Signature:
    """One documented overload of an op. ``source`` is ``docs``, ``atb`` or ``meta``."""

    name: str
    params: tuple[Param, ...]
    returns: str | None
    source: str
    text: str
    var_positional: bool = False
    var_keyword: bool = False

    @property
    def positional(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if not p.kw_only)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.params)

    @property
    def required_positional(self) -> int:
        """How many leading positional parameters have no default (what a call must pass at least)."""
        n = 0
        for p in self.positional:
            if p.default is not None:
                break
            n += 1
        return n

    def problems(
        self, n_positional: int, keywords: Sequence[str], *, star_args: bool = False, star_kwargs: bool = False
    ) -> list[str]:
        """Why a call with ``n_positional`` positional arguments and ``keywords`` does not fit (empty = it fits).

        ``star_args``/``star_kwargs`` mark calls that spread ``*seq``/``**mapping``: their counts are unknown, so
        the bounds they could satisfy are not checked.
        """
        out: list[str] = []
        pos = self.positional
        if not star_args and not self.var_positional and n_positional > len(pos):
            out.append(f"{n_positional} positional arguments given, at most {len(pos)} documented")
        filled = {p.name for p in pos[:n_positional]}
        for kw in keywords:
            if kw not in self.names and not self.var_keyword:
                out.append(f"keyword {kw!r} is not a documented parameter")
            elif kw in filled:
                out.append(f"{kw!r} is given both positionally and by keyword")
        if not star_args and not star_kwargs:
            given = filled | set(keywords)
            missing = [p.name for p in self.params if p.name not in given and not p.optional]
            if missing:
                out.append("required parameter(s) not given: " + ", ".join(missing))
        return out

    def __str__(self) -> str:
        return self.text


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside brackets/quotes: ``int[2] a=[1,1], b=(x, y)`` -> two items."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _parse_param(item: str, kw_only: bool) -> Param | None:
    """``Tensor? bias=None`` / ``bias=None`` / ``x: List[Tensor]`` / ``Tensor(a!) out`` -> Param (None if unparsable)."""
    eq = _split_top_level(item, "=")
    left, default = eq[0], ("=".join(eq[1:]).strip() if len(eq) > 1 else None)
    if ":" in left and not left.strip().startswith("func"):
        name, _, typ = left.partition(":")
        name, typ = name.strip(), typ.strip() or None
    else:
        tokens = left.split()
        if not tokens:
            return None
        name, typ = tokens[-1], (" ".join(tokens[:-1]) or None)
    if not _IDENT.match(name):
        return None
    return Param(name=name, type=typ, default=default, kw_only=kw_only)


def parse_signature(text: str, source: str = "docs") -> Signature:
    """Parse ``[torch_npu.[atb.]]name(params) [-> returns]`` into a :class:`Signature`.

    Raises ValueError when the text is not a signature (no balanced parameter list, or an item that is neither a
    parameter nor ``*``/``*args``/``**kwargs``).
    """
    text = " ".join(text.split())
    text = re.sub(r"^func:\s*", "", text)
    m = re.match(r"(?:torch_npu\s*\.\s*(?:atb\s*\.\s*|npu\s*\.\s*)?)?([A-Za-z_][\w.]*)\s*\(", text)
    if not m:
        raise ValueError(f"not a signature: {text[:80]!r}")
    name = m.group(1)
    start = m.end()
    depth, i = 1, start
    while i < len(text) and depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    if depth:
        raise ValueError(f"unbalanced parameter list in {text[:80]!r}")
    inner, rest = text[start : i - 1], text[i:].strip()
    returns = rest[2:].strip() if rest.startswith("->") else None
    params: list[Param] = []
    kw_only = var_pos = var_kw = False
    for item in _split_top_level(inner):
        if not item or item == "/":
            continue
        if item == "*":
            kw_only = True
            continue
        if item.startswith("**"):
            var_kw = True
            continue
        if item.startswith("*"):
            var_pos, kw_only = True, True
            continue
        param = _parse_param(item, kw_only)
        if param is None:
            raise ValueError(f"cannot parse parameter {item!r} of {name}")
        params.append(param)
    return Signature(name, tuple(params), returns, source, text, var_pos, var_kw)


def _signature_spans(doc: str, name: str) -> list[str]:
    """The schema text(s) of ``name`` at the head of a docstring.

    A schema starts at the beginning of a line (optionally after ``func:``) and may continue over several lines
    until its parentheses balance (plus a ``-> ret`` on the same line). Only the first one counts, plus overloads
    that follow it on the very next lines; later mentions are usage examples (``torch_npu.op(x, y=y)``), not schemas.
    """
    head = re.compile(
        r"^\s*(?:func:\s*)?(?:torch_npu\s*\.\s*(?:atb\s*\.\s*|npu\s*\.\s*)?)?" + re.escape(name) + r"\s*\("
    )
    lines = doc.splitlines()
    spans: list[str] = []
    i = 0
    last_end = None
    while i < len(lines):
        line = lines[i]
        if head.match(line) and "=" not in line.split("(", 1)[0]:
            if spans and last_end is not None and i != last_end + 1:
                break
            buf, depth, j = [], 0, i
            while j < len(lines):
                buf.append(lines[j])
                depth += lines[j].count("(") - lines[j].count(")")
                if depth <= 0:
                    break
                j += 1
            spans.append("\n".join(buf))
            last_end = j
            i = j + 1
            continue
        i += 1
    return spans


def _parse_quiet(source: str) -> ast.Module:
    """ast.parse without the wheel's own invalid-escape DeprecationWarnings (its docstrings are not raw strings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(source)


def _docstr_calls(source: str, helper: str) -> Iterable[tuple[str, str]]:
    """(name, doc) of every ``helper("name", <doc string>)`` call in a module's source (nested calls included)."""
    for node in ast.walk(_parse_quiet(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == helper
            and len(node.args) >= 2
            and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[:2])
        ):
            yield node.args[0].value, node.args[1].value


def parse_docs_module(source: str, helper: str, source_tag: str) -> dict[str, list[Signature]]:
    """Op name -> documented overloads. A name with an empty list is documented but gives no parsable schema."""
    out: dict[str, list[Signature]] = {}
    for name, doc in _docstr_calls(source, helper):
        sigs = out.setdefault(name, [])
        for span in _signature_spans(doc, name):
            try:
                sigs.append(parse_signature(span, source_tag))
            except ValueError:
                continue
    return out


def parse_meta_registrations(source: str) -> dict[str, list[Signature]]:
    """Op name -> signatures of the ``@impl(<npu library>, "name")`` meta kernels (aten ones are skipped)."""
    tree = _parse_quiet(source)
    npu_libs: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "Library"
            and node.value.args
            and isinstance(node.value.args[0], ast.Constant)
            and node.value.args[0].value == "npu"
        ):
            npu_libs.update(t.id for t in node.targets if isinstance(t, ast.Name))
    out: dict[str, list[Signature]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "impl" and len(dec.args) >= 2):
                continue
            lib, op = dec.args[0], dec.args[1]
            if not (isinstance(lib, ast.Name) and lib.id in npu_libs and isinstance(op, ast.Constant)):
                continue
            out.setdefault(op.value, []).append(_signature_from_def(op.value, node))
    return out


def _signature_from_def(name: str, fn: ast.FunctionDef) -> Signature:
    a = fn.args
    pos = [*a.posonlyargs, *a.args]
    n_def = len(a.defaults)
    params = [
        Param(p.arg, None, ast.unparse(a.defaults[i - (len(pos) - n_def)]) if i >= len(pos) - n_def else None, False)
        for i, p in enumerate(pos)
    ]
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append(Param(p.arg, None, ast.unparse(d) if d is not None else None, True))
    text = f"{name}({ast.unparse(a)})"
    return Signature(name, tuple(params), None, "meta", text, a.vararg is not None, a.kwarg is not None)


def parse_atb_api_list(source: str) -> tuple[str, ...]:
    """The names ``_atb_ops.py`` binds as ``torch_npu.<name>`` (its ``API_LIST``)."""
    for node in ast.walk(_parse_quiet(source)):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "API_LIST" for t in node.targets)
            and isinstance(node.value, ast.List)
        ):
            return tuple(e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return ()


_SCHEMA_BYTES = re.compile(rb"(_?npu_[A-Za-z0-9_]+)(\.[A-Za-z0-9_]+)?\(([ -~]*?)\) -> ([ -~]*?)\x00")


def parse_binding_schemas(binary: bytes, names: Iterable[str]) -> dict[str, list[Signature]]:
    """Op name -> the ``TORCH_LIBRARY`` schemas (``m.def("name(...) -> ...")``) of ``names`` found in a binary's
    string table. ``.out`` and other named overloads are skipped: the Python binding calls the default overload."""
    wanted = set(names)
    out: dict[str, list[Signature]] = {}
    for m in _SCHEMA_BYTES.finditer(binary):
        name, overload = m.group(1).decode(), m.group(2)
        if name not in wanted or overload:
            continue
        text = f"{name}({m.group(3).decode()}) -> {m.group(4).decode()}"
        try:
            sig = parse_signature(text, "binding")
        except ValueError:
            continue
        if all(s.text != sig.text for s in out.get(name, [])):
            out.setdefault(name, []).append(sig)
    return out


def parse_registered_schemas(binary: bytes, names: Iterable[str]) -> dict[str, list[Signature]]:
    """Op name (with its overload, ``npu_x.out``) -> the schema strings ``name(...) -> ...`` a binary registers."""
    out: dict[str, list[Signature]] = {}
    for name in names:
        start = binary.find(name.encode() + b"(")
        while start >= 0:
            end = binary.find(b"\x00", start)
            if start == 0 or not (binary[start - 1 : start].isalnum() or binary[start - 1 : start] in (b"_", b".")):
                try:
                    sig = parse_signature(binary[start:end].decode("ascii"), "registered")
                except (UnicodeDecodeError, ValueError):
                    sig = None
                if sig is not None and sig.name == name and all(s.text != sig.text for s in out.get(name, [])):
                    out.setdefault(name, []).append(sig)
            start = binary.find(name.encode() + b"(", end)
    return out


# --- the documented set ---------------------------------------------------------------------------------------


@dataclass
class TorchNPUDocs:
    """Documented signatures of ``torch_npu.<op>`` (docs, then meta) and ``torch_npu.atb.<op>``."""

    ops: dict[str, list[Signature]] = field(default_factory=dict)
    atb: dict[str, list[Signature]] = field(default_factory=dict)
    meta: dict[str, list[Signature]] = field(default_factory=dict)
    bindings: dict[str, list[Signature]] = field(default_factory=dict)
    registered: dict[str, list[Signature]] = field(default_factory=dict)
    registered_atb: dict[str, list[Signature]] = field(default_factory=dict)  # call name -> REGISTERED_ATB_SCHEMA_OPS

    def signatures(self, namespace: str, name: str) -> list[Signature] | None:
        """Overloads to check a call against; None when the op is not documented anywhere.

        ``namespace`` is ``""`` for ``torch_npu.<name>`` and ``"atb"`` for ``torch_npu.atb.<name>``. A docs entry
        without a parsable schema falls back to the meta registration, then (for the undocumented ATB ops bound as
        ``torch_npu.<name>``) to the registered binding schema; an op known only by name gives ``[]``. Ops of
        :data:`REGISTERED_SCHEMA_OPS` fit their docs or their registered schema.
        """
        table = self.atb if namespace == "atb" else self.ops
        if namespace == "atb" and name in self.registered_atb:
            return [*table.get(name, []), *self.registered_atb[name]]
        if namespace != "atb" and name in self.registered:
            return [*table.get(name, []), *self.registered[name]]
        if name in table and table[name]:
            return table[name]
        if namespace != "atb" and name in self.meta:
            return self.meta[name]
        if namespace != "atb" and name in self.bindings:
            return self.bindings[name]
        if name in table:
            return []
        return None

    def check_call(
        self,
        namespace: str,
        name: str,
        n_positional: int,
        keywords: Sequence[str],
        *,
        star_args: bool = False,
        star_kwargs: bool = False,
    ) -> list[str]:
        """Problems of one call (empty = fine). The call fits if it fits any documented overload."""
        qual = f"torch_npu.{namespace + '.' if namespace else ''}{name}"
        sigs = self.signatures(namespace, name)
        if sigs is None:
            where = "atb docs" if namespace == "atb" else "op docs, meta registrations or ATB binding schemas"
            return [f"{qual} is not in torch_npu {TORCH_NPU_VERSION}'s {where}"]
        if not sigs:
            return []  # documented by name only: existence is all that can be checked
        per_sig = [s.problems(n_positional, keywords, star_args=star_args, star_kwargs=star_kwargs) for s in sigs]
        if any(not p for p in per_sig):
            return []
        best = min(zip(per_sig, sigs, strict=True), key=lambda ps: len(ps[0]))
        return [f"{qual}: {p} (documented: {best[1].text})" for p in best[0]]


def parse_wheel(wheel: Path) -> TorchNPUDocs:
    """Parse the doc sources (and the ATB binding schemas) straight out of the wheel (a zip); nothing is extracted,
    loaded or imported."""
    with zipfile.ZipFile(wheel) as zf:
        op_src = zf.read(OP_DOCS_PATH).decode("utf-8")
        atb_src = zf.read(ATB_DOCS_PATH).decode("utf-8")
        meta_src = zf.read(META_PATH).decode("utf-8")
        atb_ops_src = zf.read(ATB_OPS_PATH).decode("utf-8")
        atb_lib = zf.read(ATB_LIB_PATH)
        torch_npu_lib = zf.read(TORCH_NPU_LIB_PATH)
    return TorchNPUDocs(
        ops=parse_docs_module(op_src, "_add_torch_npu_docstr", "docs"),
        atb=parse_docs_module(atb_src, "_add_torch_npu_atb_docstr", "atb"),
        meta=parse_meta_registrations(meta_src),
        bindings=parse_binding_schemas(atb_lib, parse_atb_api_list(atb_ops_src)),
        registered=parse_registered_schemas(torch_npu_lib, REGISTERED_SCHEMA_OPS),
        registered_atb={
            name: parse_registered_schemas(atb_lib, [overload]).get(overload, [])
            for name, overload in REGISTERED_ATB_SCHEMA_OPS.items()
        },
    )


def cache_dir() -> Path:
    return Path(os.environ.get("NPU_TESTKIT_CACHE") or Path.home() / ".cache" / "vllm-npu-tests")


def _pip_command() -> list[str]:
    """A pip to run: this interpreter's if it has one, else ``pip`` on PATH (uv venvs often ship without pip)."""
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "pip"]
    exe = shutil.which("pip") or shutil.which("pip3")
    if exe is None:
        raise DocsUnavailableError("no pip found to download torch-npu; set NPU_TESTKIT_TORCH_NPU_WHEEL to a wheel")
    return [exe]


def wheel_path(download: bool = True) -> Path:
    """The cached torch-npu wheel, downloaded once (``pip download --no-deps``) if it is not there yet."""
    explicit = os.environ.get("NPU_TESTKIT_TORCH_NPU_WHEEL")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise DocsUnavailableError(f"NPU_TESTKIT_TORCH_NPU_WHEEL={explicit!r} is not a file")
        return path
    dest = cache_dir() / "wheels"
    pattern = f"torch_npu-{TORCH_NPU_VERSION}-*.whl"
    found = sorted(dest.glob(pattern))
    if found:
        return found[0]
    if not download:
        raise DocsUnavailableError(f"no {pattern} in {dest}")
    dest.mkdir(parents=True, exist_ok=True)
    arch = "aarch64" if os.uname().machine in ("aarch64", "arm64") else "x86_64"
    errors = []
    for plat in _PLATFORMS[arch]:
        cmd = [
            *_pip_command(),
            "download",
            "--no-deps",
            f"torch-npu=={TORCH_NPU_VERSION}",
            "--platform",
            plat,
            "--python-version",
            "3.11",
            "--only-binary=:all:",
            "-d",
            str(dest),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        found = sorted(dest.glob(pattern))
        if res.returncode == 0 and found:
            return found[0]
        errors.append(f"{plat}: {(res.stderr or res.stdout).strip().splitlines()[-1:]}")
    raise DocsUnavailableError(
        f"could not download torch-npu=={TORCH_NPU_VERSION} ({'; '.join(errors)}); put the wheel in {dest} or set "
        "NPU_TESTKIT_TORCH_NPU_WHEEL"
    )


@functools.lru_cache(maxsize=1)
def load_docs() -> TorchNPUDocs:
    """The parsed torch_npu 2.8.0 docs (downloading the wheel on first use)."""
    return parse_wheel(wheel_path())


# --- scanning source for torch_npu calls: npu_call_scan (re-exported here) ------------------------------------------


def check_calls(calls: Iterable[NPUCall], docs: TorchNPUDocs) -> list[str]:
    """``path:line: problem`` for every call that does not fit torch_npu's documented contract."""
    out = []
    for c in calls:
        for problem in docs.check_call(
            c.namespace, c.name, c.n_positional, c.keywords, star_args=c.star_args, star_kwargs=c.star_kwargs
        ):
            out.append(f"{c.where}: {problem}")
    return out
