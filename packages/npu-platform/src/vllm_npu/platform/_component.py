# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The platform layer's component declaration. Imports nothing but npu-interface: discovery must stay cheap."""

from vllm_npu.interface import SUPPORTED_VLLM, Component

from ._version import __version__

COMPONENT = Component(
    name="platform",
    distribution="npu-platform",
    version=__version__,
    interface=">=1.0,<2",
    vllm=SUPPORTED_VLLM,
    summary="NPUPlatform, worker, model runner, communicator, emulated device, the vllm-npu CLI",
)
