# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The worker's torch profiler under ``VLLM_TORCH_PROFILER_DIR`` (vLLM's ``LLM.start_profile`` / ``stop_profile``,
``/start_profile`` / ``/stop_profile`` of ``vllm serve``).

vLLM's GPU worker builds ``torch.profiler.profile(activities=[CPU, CUDA])``, which records no NPU kernel. Here:

- NPU: ``torch_npu.profiler.profile`` with CPU and NPU activities, the experimental config and
  ``torch_npu.profiler.tensorboard_trace_handler(dir)``, as vllm-ascend v0.11.0 builds it
  (``worker/worker_v1.py:396-433``; signatures: torch_npu 2.8.0 ``profiler/profiler.py:171,189``,
  ``profiler/experimental_config.py:68``). The trace is torch_npu's profiling directory (``*_ascend_pt``), analysed
  when the profiler stops.
- emulated device: ``torch.profiler.profile`` with the CPU activity only, vLLM's record options, and
  ``torch.profiler.tensorboard_trace_handler(dir, use_gzip=True)`` (a ``*.pt.trace.json.gz`` per stop).
"""

from __future__ import annotations

from typing import Any

import torch
import vllm.envs as envs


def build_profiler(trace_dir: str, *, emulated: bool) -> Any:
    """The profiler object the worker starts and stops (``start()`` / ``stop()``)."""
    if emulated:
        return torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            record_shapes=envs.VLLM_TORCH_PROFILER_RECORD_SHAPES,
            profile_memory=envs.VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY,
            with_stack=envs.VLLM_TORCH_PROFILER_WITH_STACK,
            with_flops=envs.VLLM_TORCH_PROFILER_WITH_FLOPS,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir, use_gzip=True),
        )
    import torch_npu

    profiler = torch_npu.profiler
    experimental_config = profiler._ExperimentalConfig(
        export_type=profiler.ExportType.Text,
        profiler_level=profiler.ProfilerLevel.Level1,
        msprof_tx=False,
        aic_metrics=profiler.AiCMetrics.AiCoreNone,
        l2_cache=False,
        op_attr=False,
        data_simplification=False,
        record_op_args=False,
        gc_detect_threshold=None,
    )
    return profiler.profile(
        activities=[profiler.ProfilerActivity.CPU, profiler.ProfilerActivity.NPU],
        with_stack=envs.VLLM_TORCH_PROFILER_WITH_STACK,
        profile_memory=envs.VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY,
        with_modules=False,
        experimental_config=experimental_config,
        on_trace_ready=profiler.tensorboard_trace_handler(trace_dir),
    )
