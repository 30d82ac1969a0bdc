# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU side of the torchair mode: torchair's documented API, imported only here and only on an NPU.

Calls (torchair as shipped for torch_npu 2.8.0; the same calls vllm-ascend v0.11.0 makes):

- ``torch.npu.set_compile_mode(jit_compile=False)`` first: operators run from CANN's prebuilt binary kernels, not
  compiled online (torch_npu 2.8.0 ``npu/npu_config.py``: ``_npu_setOption({"jitCompile": "disable"})``), as
  vllm-ascend v0.11.0 does right before building its backend (``torchair/torchair_model_runner.py``).
- ``torchair.CompilerConfig()``: the graph-compile configuration, set as vllm-ascend v0.11.0 sets it on A2/A3
  (``torchair_model_runner.py``, with ``ascend_config.py``'s defaults): ``mode`` left at ``"max-autotune"`` (Ascend
  IR graphs compiled by GE; vllm-ascend sets it only when the user asks), ``experimental_config.frozen_parameter =
  True`` (GE binds every parameter to its device address at the first run, so the weights must not move while a
  graph lives: sleep mode recompiles after wake-up), ``experimental_config.tiling_schedule_optimize = True``
  (torch_npu's default is False; vllm-ascend turns it off only on 310P, which this plugin does not support) and
  ``experimental_config.enable_view_optimize = True`` (torch_npu's and vllm-ascend's default, spelled out).
- ``torchair.get_npu_backend(compiler_config=config)``: the ``torch.compile`` backend.
- without the cache: ``torch.compile(fn, backend=npu_backend, fullgraph=True, dynamic=True)``;
- with the cache: ``torchair.inference.cache_compile(fn, backend=npu_backend, dynamic=True, cache_dir=dir,
  ge_cache=False, fullgraph=True)``, which stores Dynamo's result (and skips Dynamo and its guards on the next
  start) under ``cache_dir/<model info>/<fn name>``. ``fn`` is a per-batch-size copy of the model's ``forward``
  with its own name (see :func:`.torchair.forward_for`), because torchair keys the cache by the function.

``dynamic=True`` with every tensor input marked static before the first call (:func:`.torchair._mark_static`: the
forward's arguments, the attention graph inputs, the KV caches; parameters are static by Dynamo's default): the only
symbolic values left are the Python ints the graph reads, the decode lengths that ``npu_fused_infer_attention_score``
takes as ``SymInt[]`` (``actual_seq_lengths_kv``). Under torchair they are graph inputs (its FIA converter packs the
list into the kernel's int64 tensor input, torch_npu 2.8.0 ``torch_npu/dynamo/torchair/_ge_concrete_graph/
ge_converter/custom/fused_infer_attention_score.py``), so new lengths neither recompile nor are baked in. vllm-ascend
v0.11.0 compiles its torchair graphs the same way (``dynamic=True`` + ``torch._dynamo.mark_static``,
``vllm_ascend/torchair/torchair_model_runner.py``). ``.tolist()`` of a lengths tensor inside the graph is not an
option: torchair has no converter for ``aten._local_scalar_dense``.

What is compiled on an NPU is refused or allowed by :func:`.config.torchair_npu_refusal` (GQA and MLA decoder
models).
Checked against a fake ``torchair`` only: no NPU here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def compile_npu(fn: Callable[..., Any], cache_dir: str | None) -> Callable[..., Any]:
    """``fn`` compiled by torchair for the NPU (cached under ``cache_dir`` when given)."""
    import torchair

    npu: Any = torch.npu  # type: ignore[attr-defined]  # registered at runtime by torch_npu (torchair imports it)
    npu.set_compile_mode(jit_compile=False)
    config = torchair.CompilerConfig()
    config.experimental_config.frozen_parameter = True
    config.experimental_config.tiling_schedule_optimize = True
    config.experimental_config.enable_view_optimize = True
    npu_backend = torchair.get_npu_backend(compiler_config=config)
    if cache_dir is None:
        return torch.compile(fn, backend=npu_backend, fullgraph=True, dynamic=True)
    return torchair.inference.cache_compile(
        fn, backend=npu_backend, dynamic=True, cache_dir=cache_dir, ge_cache=False, fullgraph=True
    )
