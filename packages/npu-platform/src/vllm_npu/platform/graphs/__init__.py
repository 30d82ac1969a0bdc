# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Static graphs: vLLM's graph wrapper for the NPU (:mod:`.wrapper`), ACL graphs (:mod:`._npu`), the emulated
device's twin (:mod:`._twin`) and the capture-size limits (:mod:`.sizes`); the torchair mode (:mod:`.torchair`: decode
compiled per batch size, with its compile cache :mod:`.compile_cache`)."""

WRAPPER_CLS = "vllm_npu.platform.graphs.wrapper.NPUGraphWrapper"
