# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Attention kernels: each NPU call beside its pure-PyTorch reference twin (same contract), picked once per layer.

One shape per kernel family: the calls of ``npu_fused_infer_attention_score`` (every layout and form) are in
:mod:`.fia`, each variant a constructor of its keyword set.

The twins of a pair keep one flat signature each (tensors positional, host values by keyword), repeated on both
sides, rather than one argument object per family: a decode twin runs as a graph task
(:func:`vllm_npu.interface.graphs.launch`), whose runtime captures the tensor arguments by address (the emulated
twin flattens them with pytree, the NPU recorder keeps weak references to each) and whose ``refresh`` / ``prepare``
replace host parameters by keyword name (``context_lens``, ``seq_lens``, ``workspace``); a frozen dataclass would
hide its tensors from both and turn every refresh into a rebuild of the object. The repetition is checked, not
trusted: ``tests/test_masks_metadata.py::test_twins_share_one_signature``.
"""
