# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU side of the torchair mode: torchair's documented API, imported only here and only on an NPU.

Calls (torchair as shipped for torch_npu 2.8.0; the same calls vllm-ascend v0.11.0 makes):

- ``torchair.CompilerConfig()``: the graph-compile configuration. We set ``experimental_config.frozen_parameter =
  True`` (weights keep their device addresses for the engine's lifetime, so GE need not re-bind them per run) and
  leave ``mode`` at its default ``"max-autotune"`` (Ascend IR graphs compiled by GE).
- ``torchair.get_npu_backend(compiler_config=config)``: the ``torch.compile`` backend.
- without the cache: ``torch.compile(fn, backend=npu_backend, fullgraph=True, dynamic=False)``;
- with the cache: ``torchair.inference.cache_compile(fn, backend=npu_backend, dynamic=False, cache_dir=dir,
  ge_cache=False, fullgraph=True)``, which stores Dynamo's result (and skips Dynamo and its guards on the next
  start) under ``cache_dir/<model info>/<fn name>``. ``fn`` is a per-batch-size copy of the model's ``forward``
  with its own name (see :func:`.torchair.forward_for`), because torchair keys the cache by the function.

Not reached today: the torchair mode is refused on an NPU (:data:`.config.TORCHAIR_ON_NPU`): GE needs an Ascend-IR
converter for vLLM's attention op (``vllm.unified_attention_with_output``), which reads each step's metadata in
Python and so cannot have one. The wiring stays, checked against a fake ``torchair``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def compile_npu(fn: Callable[..., Any], cache_dir: str | None) -> Callable[..., Any]:
    """``fn`` compiled by torchair for the NPU (cached under ``cache_dir`` when given)."""
    import torchair

    config = torchair.CompilerConfig()
    config.experimental_config.frozen_parameter = True
    npu_backend = torchair.get_npu_backend(compiler_config=config)
    if cache_dir is None:
        return torch.compile(fn, backend=npu_backend, fullgraph=True, dynamic=False)
    return torchair.inference.cache_compile(
        fn, backend=npu_backend, dynamic=False, cache_dir=cache_dir, ge_cache=False, fullgraph=True
    )
