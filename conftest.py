# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Root pytest configuration, loaded before any test module of the workspace (and in every xdist worker).

The suite runs with ``-n 2`` on a 2-core machine and its vLLM engines start further processes. torch's OpenMP pool
defaults to one thread per core in every one of them, and oversubscribed OpenMP barriers spin: a CPU step then runs
tens of times slower. One intra-op thread per process keeps the whole suite within the machine. Set before torch is
imported anywhere; child processes inherit it. An explicit setting of the caller wins.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The suite exercises the emulated device. vLLM resolves its platform once per process, on first use, and an xdist
# worker runs many modules: whichever touches vLLM first would otherwise fix the platform (to UnspecifiedPlatform on
# this CPU host) for all the others. Tests of other VLLM_NPU_DEVICE values set it explicitly (monkeypatch +
# reset_device_selection for the pure decision logic, a subprocess for vLLM's own platform resolution).
os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
