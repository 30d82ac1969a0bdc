# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Attention kernels: each NPU call beside its pure-PyTorch reference twin (same contract), picked once per layer."""
