# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""KV pulls over Mooncake's TCP transport between two processes on 127.0.0.1: the handshake, direct block copies,
the head split between prefill TP=2 and decode TP=1, the MLA two-plane cache, and the prefill side's release."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from npu_testkit.serve import free_port
from npu_testkit.system_libs import require_mooncake_libraries

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _producer import BS, CONFIGS, HEADS, LORA, NB, PORTS_USED, ROPE, full_caches  # noqa: E402
from vllm_npu.kv._worker_side import WorkerSide  # noqa: E402
from vllm_npu.kv.layout import LayoutError  # noqa: E402
from vllm_npu.kv.metadata import MooncakeConnectorMetadata, RecvTask  # noqa: E402
from vllm_npu.kv.params import RemotePrefill  # noqa: E402
from vllm_npu.kv.settings import ConnectorSettings  # noqa: E402
from vllm_npu.kv.side_channel import SideChannelClient, SideChannelError  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _mooncake_loads() -> None:
    """The Mooncake build is in the dev group; its engine needs system libraries scripts/system_libs.py installs.
    Without them every test here fails with the apt line (no skip: the transfer path would go untested)."""
    require_mooncake_libraries()


PRODUCER = Path(__file__).resolve().parent / "_producer.py"


class Producer:
    def __init__(self) -> None:
        self.port = free_port(PORTS_USED)
        self.proc = subprocess.Popen(
            [sys.executable, str(PRODUCER), str(self.port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.readline(120) == "ready"

    def config_port(self, config: str) -> int:
        return self.port + CONFIGS[config][2]

    def readline(self, timeout: float) -> str:
        """The producer's next protocol line (vLLM's own log lines go to stdout too)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the producer exited with {self.proc.wait()}")
            if line.startswith(("ready", "released")):
                return line.strip()
        raise AssertionError("the producer did not answer in time")

    def released(self, expected: int, timeout: float = 10.0) -> list[str]:
        return [self.readline(timeout) for _ in range(expected)]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    """One producer process for the module (it imports vLLM: ~10-20 s to start)."""
    p = Producer()
    yield p
    p.close()


def consumer(kind: str, tp_rank: int = 0, tp: int = 1) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    settings = ConnectorSettings("127.0.0.1", 1, 30.0, 5.0, "kv_consumer")
    w = WorkerSide(settings, "decode-engine", tp_rank, tp, BS, LORA if kind == "mla" else None)
    caches = {k: torch.zeros_like(v) for k, v in full_caches(kind).items()}
    w.register_kv_caches(caches)
    return w, caches


def pull(w: WorkerSide, port: int, tp: int, local: list[int], remote: list[int], req: str = "req-0") -> None:
    task = RecvTask(tuple(local), RemotePrefill(tuple(remote), "prefill-engine", "127.0.0.1", port, tp))
    w.start_load_kv(MooncakeConnectorMetadata(reqs_to_recv={req: task}))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _, recving = w.get_finished()
        if recving:
            assert recving == {req}
            return
        time.sleep(0.01)
    raise AssertionError("the pull did not finish")


def mla_planes(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLA cache's nope plane [nb, bs, L] and rope plane [nb, bs, R] (npu-attention's latent_cache_planes)."""
    flat = cache.view(-1)
    return flat[: NB * BS * LORA].view(NB, BS, LORA), flat[NB * BS * LORA :].view(NB, BS, ROPE)


# Local blocks in a different order and place than the remote ones, with a consecutive run (5, 6, 7 <- 1, 2, 3).
LOCAL, REMOTE = [5, 6, 7, 0, 11], [1, 2, 3, 9, 4]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_pull_places_every_block_and_releases_the_prefill_side(producer: Producer, config: str) -> None:
    kind, tp, _ = CONFIGS[config]
    req = f"req-{list(CONFIGS).index(config)}"
    w, caches = consumer(kind)
    try:
        pull(w, producer.config_port(config), tp, LOCAL, REMOTE, req)
        stats = w.take_stats()
        assert stats is not None and stats.data["transfers"] == 1 and stats.data["failed"] == []
        full = full_caches(kind)
        for name, cache in caches.items():
            want = torch.zeros_like(cache)
            if kind == "gqa":
                want[:, LOCAL] = full[name][:, REMOTE]
            else:
                for got_plane, full_plane in zip(mla_planes(want), mla_planes(full[name])):
                    got_plane[LOCAL] = full_plane[REMOTE]
            torch.testing.assert_close(cache, want, rtol=0, atol=0)
        assert sorted(producer.released(tp)) == [f"released {req} {config} rank {r}" for r in range(tp)]
        # Bytes moved: every block of every layer (both planes), once.
        per_block = caches[next(iter(caches))].numel() // NB * 4
        assert stats.data["bytes"] == len(LOCAL) * per_block * len(caches)
    finally:
        w.shutdown()


def test_handshake_reports_the_prefill_layout(producer: Producer) -> None:
    client = SideChannelClient("127.0.0.1", producer.config_port("gqa-tp1"), timeout_s=5)
    meta = client.metadata()
    client.close()
    assert (meta.engine_id, meta.tp_rank, meta.tp_size, meta.block_size) == ("prefill-gqa-tp1", 0, 1, BS)
    assert [layer.name for layer in meta.layers] == list(full_caches("gqa"))
    layer = meta.layers[0]
    assert layer.num_blocks == NB and not layer.replicated
    assert [(p.offset, p.block_bytes, p.heads) for p in layer.planes] == [
        (0, BS * HEADS * 8 * 4, HEADS),
        (NB * BS * HEADS * 8 * 4, BS * HEADS * 8 * 4, HEADS),
    ]
    assert meta.session_id.startswith("127.0.0.1:")


def test_unreachable_prefill_fails_the_pull_and_reports_it() -> None:
    w, caches = consumer("gqa")
    w.settings = ConnectorSettings("127.0.0.1", 1, 30.0, 0.3, "kv_consumer")
    try:
        port = free_port()  # nothing listens there
        pull(w, port, 1, [0], [0])
        stats = w.take_stats()
        assert stats is not None and stats.data["failed"] == ["req-0"] and stats.data["transfers"] == 0
        assert all(not c.any() for c in caches.values())  # nothing was written
    finally:
        w.shutdown()


def test_side_channel_timeout_names_the_address() -> None:
    port = free_port()
    client = SideChannelClient("127.0.0.1", port, timeout_s=0.2)
    with pytest.raises(SideChannelError, match=f"127.0.0.1:{port} did not answer 'meta'"):
        client.metadata()
    client.close()


def test_block_size_mismatch_is_refused(producer: Producer) -> None:
    settings = ConnectorSettings("127.0.0.1", 1, 30.0, 5.0, "kv_consumer")
    w = WorkerSide(settings, "decode-engine", 0, 1, BS * 2, None)
    try:
        w.register_kv_caches({k: torch.zeros(2, NB, BS * 2, HEADS, 8) for k in full_caches("gqa")})
        task = RecvTask((0,), RemotePrefill((0,), "prefill-engine", "127.0.0.1", producer.config_port("gqa-tp1"), 1))
        with pytest.raises(LayoutError, match="block_size=16, this decode instance 32"):
            w.pull(task)
    finally:
        w.shutdown()


class _FaultyEngine:
    """Mooncake's real engine, except that ``batch_transfer_sync_read`` moves only the first segment and then
    returns an error code (``fault="code"``) or raises (``fault="raise"``): a transfer error at the engine
    boundary, after part of the data has landed."""

    fault = "code"

    def __init__(self) -> None:
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def batch_transfer_sync_read(self, session_id, local, remote, lengths) -> int:
        self._engine.batch_transfer_sync_read(session_id, local[:1], remote[:1], lengths[:1])
        if self.fault == "raise":
            raise RuntimeError("transfer engine: connection reset by peer")
        return -1


@pytest.mark.parametrize("fault", ["code", "raise"])
def test_transfer_error_fails_the_pull_and_releases_the_prefill_side(producer: Producer, fault: str) -> None:
    """The read fails after a partial copy: the pull is reported finished *and* failed (the scheduler then frees the
    request's blocks and recomputes its prompt), nothing counts as transferred, and the prefill side is told
    ``done`` so it frees its blocks at once rather than at the timeout."""
    engine_cls = type(f"Faulty_{fault}", (_FaultyEngine,), {"fault": fault})
    settings = ConnectorSettings("127.0.0.1", 1, 30.0, 5.0, "kv_consumer")
    w = WorkerSide(settings, "decode-engine", 0, 1, BS, None, engine_cls=engine_cls)
    caches = {k: torch.zeros_like(v) for k, v in full_caches("gqa").items()}
    w.register_kv_caches(caches)
    req = "req-6" if fault == "code" else "req-7"
    try:
        pull(w, producer.config_port("gqa-tp1"), 1, LOCAL, REMOTE, req)
        stats = w.take_stats()
        assert stats is not None and stats.data["failed"] == [req]
        assert stats.data["transfers"] == 0 and stats.data["bytes"] == 0
        assert any(c.any() for c in caches.values())  # part of the data had landed before the error
        assert producer.released(1) == [f"released {req} gqa-tp1 rank 0"]
    finally:
        w.shutdown()
