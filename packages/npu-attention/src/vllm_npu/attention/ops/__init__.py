"""Attention kernels: each NPU call beside its pure-PyTorch reference twin (same contract), picked once per layer."""
