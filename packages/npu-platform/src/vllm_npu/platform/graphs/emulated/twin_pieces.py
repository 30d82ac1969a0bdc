# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The pure pieces of a compiled twin graph (:mod:`.twin_compile`), compiled by inductor once per distinct piece.

A pure piece is an FX graph of aten ops with every tensor it reads as an argument: activations and the layer's
weights alike (the split passes the captured graph's constants to its pieces as arguments). So the pieces of
same-shaped decoder layers differ only in which tensors they are called with, and one compiled function serves
them all: pieces are keyed by :func:`piece_digest` (the piece re-traced with inductor's decompositions, whose
generated code names nothing after the layer, plus every input's shape, stride, dtype and device and the bytes of
any tensor constant) and compiled once per key per process.

Compilation is inductor's ``compile_fx_inner`` on the re-traced piece (the piece is already a functional aten
graph: AOTAutograd's tracing and its runtime wrappers, which ``compile_fx`` adds, would only cost time at start-up
and ~50 us per call). The compiled function is inductor's generated ``call``, called with the argument list.

On-disk cache (``cache`` given, see :class:`.compile_cache.CompileCache`): the artifacts inductor's own FX-graph
cache makes for a piece (its generated code; the C++ kernels it builds are in inductor's kernel cache,
``TORCHINDUCTOR_CACHE_DIR``) are kept as ``twin-<digest>.bin`` in the key's directory; a later process loads
them into inductor's cache and compiles the piece again, which then is a cache hit (no lowering, no code
generation). The file's bytes are inductor's (``torch.compiler.save_cache_artifacts``); loading them runs the
code they hold, so the directory must be as trusted as the model checkpoint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..wrapper import PIECE_STATS
from ._twin_code import load_code, store_code, structure_key
from .twin import one_meta_mode

if TYPE_CHECKING:
    from ..compile_cache import CompileCache

logger = logging.getLogger(__name__)


# What vLLM's CPU platform sets for its inductor compiles, and one compile worker: a pool of worker processes
# costs more to start on a small host than it saves for a few kernels per piece. ``size_asserts`` off: the
# generated code checks no extern kernel's output strides per call (~50 checks per decode step).
_INDUCTOR_CONFIG = {
    "dce": True,
    "size_asserts": False,
    "nan_asserts": False,
    "epilogue_fusion": True,
    "compile_threads": 1,
}
# digest -> compiled function of that piece (boxed: takes the argument list), for this process
_COMPILED: dict[str, Callable[[list[Any]], Any]] = {}


def _decomposed(piece: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """``piece`` re-traced functionalized with inductor's decompositions, returning a tuple (as
    ``compile_fx_inner`` requires); placeholders and nodes are named by position and op only, so identical
    computations give identical code.

    Functionalized because ``compile_fx_inner`` skips AOTAutograd, which is what turns in-place ops on intermediates
    (the RMSNorm twin's ``rsqrt_``, ...) into their functional forms for ``compile_fx``: left in place, inductor lowers
    them as implicit fallbacks, slower, and an error wherever the ``CI`` environment variable is set (inductor's
    ``make_fallback`` refuses a fallback for an op that has a decomposition there). A pure piece mutates none of its
    inputs, so nothing is copied back."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    def as_tuple(*args: torch.Tensor) -> tuple[Any, ...]:
        out = piece(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    with torch.no_grad(), one_meta_mode():
        return make_fx(functionalize(as_tuple), decomposition_table=select_decomp_table(), tracing_mode="real")(*inputs)


def piece_digest(gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> str:
    """sha256 of a re-traced piece: its code, its inputs' metadata and its tensor constants' bytes."""
    digest = hashlib.sha256(gm.code.encode())
    for x in inputs:
        digest.update(f"T{tuple(x.shape)}{x.stride()}{x.storage_offset()}{x.dtype}{x.device.type};".encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                digest.update(f"C{node.target}{tuple(value.shape)}{value.dtype};".encode())
                digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _inductor(
    gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor], vec_isa_ok: bool | None = None
) -> tuple[Callable[[list[Any]], Any], Any]:
    """``compile_fx_inner`` under a tracing context with a shape environment (inductor's FX-graph cache needs one),
    inference only; the generated ``call`` (boxed) and inductor's compiled graph (its ``source_code``)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(x, static_shapes=True) for x in inputs]
    patch = {**_INDUCTOR_CONFIG, **({} if vec_isa_ok is None else {"cpp.vec_isa_ok": vec_isa_ok})}
    with tracing(TracingContext(fake_mode)), torch.no_grad(), torch._inductor.config.patch(patch):
        compiled = compile_fx_inner(gm, fakes, is_inference=True)
    call = getattr(compiled, "current_callable", None)
    return call if call is not None else compiled, compiled


def _vec_isa_fingerprint() -> dict[str, Any]:
    """What decides inductor's check of the CPU's vector ISAs: the CPU's ISA flags, the C++ compiler, torch."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.cpu_vec_isa import x86_isa_checker

    compiler = shutil.which(get_cpp_compiler()) or get_cpp_compiler()
    stat = os.stat(compiler) if os.path.exists(compiler) else None
    return {
        "cpu_isa": sorted(x86_isa_checker()),
        "compiler": [compiler, stat.st_size if stat else None, stat.st_mtime_ns if stat else None],
        "torch": torch.__version__,
    }


def _vec_isa_ok(cache: CompileCache) -> bool | None:
    """Inductor checks, once per process before its first C++ kernel, that each vector ISA the CPU reports builds
    and loads (one compile plus one Python subprocess importing torch per ISA: seconds at every engine start).
    The result is kept in the cache directory with what decides it (:func:`_vec_isa_fingerprint`): True when every
    ISA the CPU reports passed, and then this and every later process with the same fingerprint compiles with
    ``torch._inductor.config.cpp.vec_isa_ok=True`` (the same ISAs, no check; the same inductor configuration, so
    the cached pieces of one process are found by the next). None: inductor checks as usual.
    """
    import json

    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list, valid_vec_isa_list

    if inductor_config.cpp.vec_isa_ok is not None or os.uname().machine not in ("x86_64", "AMD64"):
        return None  # set by the user (TORCHINDUCTOR_VEC_ISA_OK), or not the x86 check
    marker = cache.directory / "vec_isa.json"
    fingerprint = _vec_isa_fingerprint()
    try:
        stored = json.loads(marker.read_text())
    except (OSError, ValueError):
        stored = None
    if stored is not None and stored.get("fingerprint") == fingerprint:
        return True if stored.get("ok") is True else None
    flags = fingerprint["cpu_isa"]
    candidates = [str(isa) for isa in supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    ok = bool(candidates) and [str(isa) for isa in valid_vec_isa_list()] == candidates  # runs the check
    cache.prepare()
    tmp = marker.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "ok": ok}))
    tmp.replace(marker)
    return True if ok else None


def _compile(
    gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor], digest: str, cache: CompileCache | None
) -> tuple[Callable[[list[Any]], Any], Any]:
    """The piece compiled (inductor's FX-graph cache fed from ``twin-<digest>.bin`` when the cache has it); the
    generated ``call`` and inductor's compiled graph."""
    if cache is None:
        return _inductor(gm, inputs)
    vec_isa_ok = _vec_isa_ok(cache)
    from torch._inductor.codecache import FxGraphCache  # noqa: F401  (registers inductor's cache artifact types)
    from torch.compiler._cache import CacheArtifactManager

    path = cache.directory / f"twin-{digest[:32]}.bin"
    if path.exists():
        torch.compiler.load_cache_artifacts(path.read_bytes())
        counters_before = _fx_cache_hits()
        result = _inductor(gm, inputs, vec_isa_ok)
        if _fx_cache_hits() > counters_before:
            PIECE_STATS.disk_hits += 1
            return result
        PIECE_STATS.reasons["stored artifacts not used by inductor"] += 1
        return result
    with CacheArtifactManager.with_fresh_cache():
        result = _inductor(gm, inputs, vec_isa_ok)
        saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[1].inductor_artifacts:
        PIECE_STATS.reasons["inductor made no cache artifact"] += 1
        return result
    cache.prepare()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(saved[0])
    tmp.replace(path)
    PIECE_STATS.disk_writes += 1
    return result


def _fx_cache_hits() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"])


def compile_piece(
    piece: torch.fx.GraphModule, inputs: Sequence[torch.Tensor], cache: CompileCache | None = None
) -> Callable[..., Any]:
    """``piece`` (pure: no writes to its arguments) compiled, called like ``piece``; shared with every identical
    piece compiled before in this process (see the module docstring). With ``cache``, a piece whose
    :func:`structure_key` has stored code loads that code (:mod:`._twin_code`) without re-tracing or inductor."""
    key = structure_key(piece, inputs)
    call = _COMPILED.get(key) if key is not None else None
    PIECE_STATS.pieces += 1
    if call is not None:
        PIECE_STATS.shared += 1
        return _caller(piece, call)
    if key is not None and cache is not None:
        call = load_code(cache, key, _INDUCTOR_CONFIG, _vec_isa_ok)
        if call is not None:
            PIECE_STATS.compiles += 1
            PIECE_STATS.disk_hits += 1
            _COMPILED[key] = call
            return _caller(piece, call)
    gm = _decomposed(piece, inputs)
    digest = piece_digest(gm, inputs)
    call = _COMPILED.get(digest)
    if call is None:
        PIECE_STATS.compiles += 1
        call, compiled = _compile(gm, inputs, digest, cache)
        _COMPILED[digest] = call
        if key is not None and cache is not None:
            store_code(cache, key, compiled)
    else:
        PIECE_STATS.shared += 1
    if key is not None:
        _COMPILED[key] = call
    return _caller(piece, call)


def _caller(piece: torch.fx.GraphModule, call: Callable[[list[Any]], Any]) -> Callable[..., Any]:
    if not _returns_tuple(piece):
        return lambda *args: call(list(args))[0]
    return lambda *args: call(list(args))


def _returns_tuple(piece: torch.fx.GraphModule) -> bool:
    output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
    return isinstance(output.args[0], (tuple, list))
