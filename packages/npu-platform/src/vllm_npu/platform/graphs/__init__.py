# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Static graphs: vLLM's graph wrapper for the NPU (:mod:`.wrapper`), ACL graphs (:mod:`._npu`), the emulated
device's twin (:mod:`.emulated.twin`), the graph mode of an engine (:mod:`.config`) and the capture-size limit
(:mod:`.sizes`); the torchair mode (:mod:`.torchair`: the decode forward compiled per batch size, with its compile
cache :mod:`.compile_cache`). Importing this package costs nothing."""

from vllm_npu.interface import NPUPluginError

WRAPPER_CLS = "vllm_npu.platform.graphs.wrapper.NPUGraphWrapper"


class GraphInputMovedError(NPUPluginError, RuntimeError):
    """A captured graph was replayed with an input tensor at another address than at capture, or after a tensor it
    captured by reference (a weight, a KV cache, a task argument) moved or was freed: the graph would read the old
    buffer. The caller must copy new inputs into the captured buffers, and capture again after moving weights or
    caches (sleep mode's wake-up)."""
