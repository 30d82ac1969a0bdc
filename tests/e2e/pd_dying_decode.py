# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A decode worker that dies mid-transfer: ``python pd_dying_decode.py HOST PORT BLOCK_IDS_JSON``.

Does what a decode worker of npu-kv's connector does first (the side-channel handshake with the prefill rank at
``HOST:PORT``, its own Mooncake engine over TCP), reads the first half of the request's blocks of the first layer
from the prefill instance, prints ``partial <bytes>`` and then waits to be killed: it never sends ``done``, as a
decode instance that dies mid-transfer does not.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from vllm_npu.kv.engine import PROTOCOLS, TransferEngineHandle
from vllm_npu.kv.side_channel import SideChannelClient


def main() -> None:
    host, port, block_ids = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    agent = SideChannelClient(host, port, 10.0).metadata()
    layer = agent.layers[0]
    engine = TransferEngineHandle("127.0.0.1", PROTOCOLS["emulated"])
    half = block_ids[: max(1, len(block_ids) // 2)]
    plane = layer.planes[0]
    buf = torch.zeros(len(half) * plane.block_bytes, dtype=torch.uint8)
    engine.register(buf.data_ptr(), buf.numel())
    local = [buf.data_ptr() + i * plane.block_bytes for i in range(len(half))]
    remote = [layer.base + plane.offset + b * plane.block_bytes for b in half]
    engine.read(agent.session_id, local, remote, [plane.block_bytes] * len(half))
    assert buf.any(), "the partial read moved no data"
    print(f"partial {buf.numel()}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
