# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Offline tooling of the quant layer, never imported while serving: ``vllm-npu quantize`` (:mod:`.cli`), the
quantizer that writes msModelSlim-format checkpoints (:mod:`.quantizer`, its maths :mod:`.quantize_math` and path
checks :mod:`.quantize_paths`) and the pure-torch simulation of a quantized checkpoint (:mod:`.simulate`). Importing
this package costs nothing."""
