# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Inductor's generated code of a compiled twin piece, kept on disk under a key computed from the piece itself.

A warm start used to pay, per piece and capture size, a re-trace of the piece with inductor's decompositions (the
key of :func:`.twin_pieces.piece_digest`), inductor's import and its FX-graph cache lookup (hashing the graph
again), before the stored code was found: on the demo model ~70 % of the compiled mode's capture time with every
piece a disk hit (py-spy; docs/graphs.md). The key here needs none of that: :func:`structure_key` hashes the
piece as split (each node's op, target and arguments, with nodes named by position, so equal layers give equal
keys) with its inputs' metadata, its constants' bytes and what decides the generated code (torch, the inductor
options, the CPU's vector ISAs and the C++ compiler). The stored file is inductor's generated Python module for
that piece (``source_code``), loaded with inductor's own loader (``PyCodeCache.load_by_key_path``), whose C++
kernels come from inductor's kernel cache (``TORCHINDUCTOR_CACHE_DIR``), or are built again when that is gone.

Loading the file runs the code it holds: the directory must be as trusted as the model checkpoint (as the
``twin-*.bin`` artifacts next to it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from ..compile_cache import CompileCache

logger = logging.getLogger(__name__)


class _Ref:
    """A node argument named by its position in the piece (``%3``), not by its traced name."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"%{self.index}"


def _target_name(target: Any) -> str | None:
    """A process-independent name of a node's target; None when there is none (a local function, a lambda)."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not isinstance(qualname, str) or "<" in qualname:
        return None
    return f"{module}.{qualname}"


@functools.cache
def _environment() -> str:
    """What decides inductor's code for a given graph besides the graph: versions, the CPU's vector ISAs, the C++
    compiler (see :func:`.twin_pieces._vec_isa_fingerprint`)."""
    from .twin_pieces import _INDUCTOR_CONFIG, _vec_isa_fingerprint

    fingerprint = _vec_isa_fingerprint() if os.uname().machine in ("x86_64", "AMD64") else {}
    return repr((torch.__version__, sys.version_info[:2], sorted(_INDUCTOR_CONFIG.items()), fingerprint))


def structure_key(piece: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> str | None:
    """sha256 of ``piece`` as split (see the module docstring), or None when a node has no stable description (a
    local function as target, an argument whose repr holds an address): such a piece takes the re-traced path."""
    digest = hashlib.sha256(_environment().encode())
    index: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(piece.graph.nodes):
        index[node] = i
        if node.op == "get_attr":
            value = getattr(piece, str(node.target))
            if not isinstance(value, torch.Tensor):
                return None
            digest.update(f"C{tuple(value.shape)}{value.stride()}{value.dtype};".encode())
            digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            continue
        target = "" if node.op in ("placeholder", "output") else _target_name(node.target)
        if target is None:
            return None
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: cast(Any, _Ref(index[n])))
        text = f"{node.op}|{target}|{args!r};"
        if " at 0x" in text:
            return None
        digest.update(text.encode())
    for x in inputs:
        digest.update(f"T{tuple(x.shape)}{x.stride()}{x.storage_offset()}{x.dtype}{x.device.type};".encode())
    return digest.hexdigest()


def _path(cache: CompileCache, key: str) -> Any:
    return cache.directory / f"twin-code-{key[:40]}.py"


def store_code(cache: CompileCache, key: str, compiled: Any) -> bool:
    """Keep the generated module of ``compiled`` (inductor's compiled graph) under ``key``; False when it cannot be
    reloaded alone (no source, or constants inductor passes to the module at load)."""
    source = getattr(compiled, "source_code", None)
    if not isinstance(source, str) or getattr(compiled, "constants", None):
        return False
    path = _path(cache, key)
    cache.prepare()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(source)
    tmp.replace(path)
    return True


def load_code(
    cache: CompileCache,
    key: str,
    inductor_config: Mapping[str, Any],
    vec_isa_ok: Callable[[CompileCache], bool | None],
) -> Callable[[list[Any]], Any] | None:
    """The generated ``call`` stored under ``key`` (boxed: takes the argument list), None when there is none or it
    does not load (logged; the caller compiles). ``inductor_config``: the options the piece was compiled with, which
    its C++ kernels are built with when inductor's kernel cache lacks them."""
    path = _path(cache, key)
    if not path.exists():
        return None
    from torch._inductor.codecache import PyCodeCache

    ok = vec_isa_ok(cache)
    patch = {**inductor_config, **({} if ok is None else {"cpp.vec_isa_ok": ok})}
    try:
        with torch._inductor.config.patch(patch):
            module = PyCodeCache.load_by_key_path(f"twin_{key[:40]}", str(path))
        call = module.call
    except Exception as e:  # a truncated or stale file: compile as if it were not there
        logger.warning("stored twin piece %s did not load (%s: %s); compiling it again", path, type(e).__name__, e)
        return None
    return call
