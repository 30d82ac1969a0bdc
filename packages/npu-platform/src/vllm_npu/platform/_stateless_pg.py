# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Stateless device process groups: the platform's ``stateless_init_device_torch_dist_pg``.

vLLM's ``vllm.distributed.utils.stateless_init_torch_distributed_process_group(host, port, rank, world_size,
backend)`` builds a process group outside ``torch.distributed``'s global state (RL frameworks use it to sync weights
between trainer and vLLM workers). It builds gloo groups itself and asks the platform for any other backend.

- NPU (``backend="hccl"``): a ``ProcessGroup`` whose NPU backend is torch_npu's ``ProcessGroupHCCL`` with the caller's
  timeout, exactly as vllm-ascend v0.11.0 builds it (``platform.py:389-423``); torch_npu 2.8.0 constructs the class
  the same way in its own backend hook (``torch_npu/__init__.py:233-243``: ``ProcessGroupHCCL(store, group_rank,
  group_size, options)``, ``options._timeout``).
- emulated device: the group runs on gloo (the emulated device's ``dist_backend``), whatever backend the caller
  named, so a script written for an Ascend host (``backend="hccl"``) runs unchanged on CPU tensors.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed
from torch.distributed import Backend, PrefixStore, ProcessGroup
from vllm_npu.interface import ConfigError

#: Backends a stateless group on the NPU can use.
NPU_BACKENDS = ("hccl",)


def hccl_process_group(prefix_store: PrefixStore, group_rank: int, group_size: int, timeout: timedelta) -> ProcessGroup:
    """A stateless HCCL group: collectives on ``npu`` tensors go to torch_npu's ``ProcessGroupHCCL``."""
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # imports torch_npu, which adds the check below

    # torch_npu's import adds torch.distributed.is_hccl_available (torch_npu/__init__.py:192).
    if not torch.distributed.is_hccl_available():  # type: ignore[attr-defined]
        raise ConfigError("a stateless 'hccl' process group needs torch_npu's HCCL backend, which is not available")
    pg = ProcessGroup(prefix_store, group_rank, group_size)
    options = ProcessGroupHCCL.Options()
    options._timeout = timeout
    backend = ProcessGroupHCCL(prefix_store, group_rank, group_size, options)
    # As vllm-ascend v0.11.0: the sequence number of a fresh group, then the backend registered for the npu device
    # type as a CUSTOM backend (torch has no HCCL enum value).
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device("npu"), ProcessGroup.BackendType.CUSTOM, backend)
    return pg


def stateless_device_group(
    backend: str,
    prefix_store: PrefixStore,
    group_rank: int,
    group_size: int,
    timeout: timedelta,
    *,
    emulated: bool,
) -> ProcessGroup:
    """The platform hook's answer (see the module docstring); any other backend is a :class:`ConfigError`."""
    if emulated:
        from vllm.distributed.utils import init_gloo_process_group

        return init_gloo_process_group(
            backend=Backend("gloo"),
            prefix_store=prefix_store,
            group_rank=group_rank,
            group_size=group_size,
            timeout=timeout,
        )
    if str(backend).lower() not in NPU_BACKENDS:
        raise ConfigError(
            f"a stateless process group with backend {backend!r} is not supported on the NPU; use backend='hccl' "
            "for NPU tensors or 'gloo' for CPU tensors"
        )
    return hccl_process_group(prefix_store, group_rank, group_size, timeout)
