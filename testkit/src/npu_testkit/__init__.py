# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Private test support for vllm-npu-plugin (never published). One module per job:

- :mod:`.engine`: real-vLLM engines on the emulated device (its docstring is the stable contract the tests use);
- :mod:`.models`: tiny Hugging Face checkpoints built on the fly, and HF reference generation;
- :mod:`.graph_e2e`: the shared scenario (engine and checks) of the static-graph engine modules;
- :mod:`.structured`: structured output of every constraint kind, validated, against HF greedy under xgrammar;
- :mod:`.serve`: ``vllm serve`` as a subprocess, ready when ``/v1/models`` answers;
- :mod:`.sibling`: import a helper module that sits next to a test file;
- :mod:`.distributed`: a one-rank vLLM process group for layer tests without an engine;
- :mod:`.quant_e2e`: the shared end-to-end checks of the ``ascend`` quant method;
- :mod:`.torch_npu_docs`: torch_npu 2.8.0's documented op signatures, read from the wheel without importing it;
- :mod:`.npu_call_scan` / :mod:`.runtime_calls`: the torch_npu kernel calls / runtime calls of a source file (AST),
  for the signature check and the two tables of ``docs/npu-calls.md``;
- :mod:`.npu_binding_rules`: what torch_npu 2.8.0's bindings and kernels impose beyond those signatures, for the
  stand-in torch_npu of the NPU-wiring tests.
- :mod:`.npu_runtime_standin`: a stand-in torch_npu for the runtime calls (device, memory, profiler, ATB, HCCL
  groups) that keeps torch_npu 2.8.0's lazy-initialisation and fork rule.
- :mod:`.import_light`: ``assert_import_light``, the "a door or hook imports no torch/vLLM" check in a fresh
  interpreter.
"""
