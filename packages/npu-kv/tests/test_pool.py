# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The KV pool's parts without an engine: its configuration (vllm-ascend's ``MOONCAKE_CONFIG_PATH`` keys), the
store handle against a real ``mooncake_master`` on 127.0.0.1 (unreachable master, zero-copy round trip, a dead
master), the scheduler-side lookup, and the worker's bookkeeping of delayed frees and failed loads."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
from npu_testkit.serve import free_port
from npu_testkit.system_libs import require_mooncake_libraries
from vllm_npu.interface import ConfigError
from vllm_npu.kv.pool.config import pool_config
from vllm_npu.kv.pool.manager import PoolLoadStoreSpec, PoolManager, block_key, parts
from vllm_npu.kv.pool.store import PoolStore
from vllm_npu.kv.pool.worker import PoolWorker

STORE = {"master_server_address": "127.0.0.1:1", "local_hostname": "127.0.0.1"}


# --- configuration ---------------------------------------------------------------------------------------------


def test_config_from_the_vllm_ascend_file_with_inline_overrides(tmp_path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "local_hostname": "10.0.0.2",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": "10.0.0.1:50088",
                "global_segment_size": 1024,
                "protocol": "ascend",
                "device_name": "",
                "use_ascend_direct": True,
            }
        )
    )
    cfg = pool_config({"local_buffer_size": 4096}, {"MOONCAKE_CONFIG_PATH": str(path)})
    assert cfg.master_host_port == ("10.0.0.1", 50088)
    assert (cfg.local_hostname, cfg.global_segment_size, cfg.local_buffer_size) == ("10.0.0.2", 1024, 4096)
    assert cfg.protocol == "ascend" and cfg.metadata_server == "P2PHANDSHAKE"
    # vllm-ascend's defaults where the file says nothing
    assert pool_config(STORE, {}).global_segment_size == 3355443200
    assert pool_config(STORE, {}).local_buffer_size == 1073741824


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({}, "master_server_address"),
        ({"master_server_address": "nohostport"}, "host:port"),
        ({**STORE, "global_segment_size": "3GB"}, "global_segment_size"),
        ({**STORE, "num_cpu_blocks": 4}, "unknown keys"),
        ({**STORE, "master_timeout_s": 0}, "master_timeout_s"),
        ({**STORE, "mooncake_config_path": "/nonexistent/x.json"}, "cannot be read"),
    ],
)
def test_config_errors_name_the_key(extra: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        pool_config(extra, {})


# --- the store handle, on a real master ------------------------------------------------------------------------


def test_unreachable_master_at_start_serves_without_the_pool() -> None:
    require_mooncake_libraries()
    start = time.monotonic()
    store = PoolStore(pool_config({**STORE, "master_server_address": f"127.0.0.1:{free_port()}"}, {}), 0, "test")
    assert not store.available and time.monotonic() - start < 10  # the store's own setup would retry for ~90 s
    assert store.exists(["k"]) == [False] and store.get(["k"], [[0]], [[1]])[0] < 0
    assert PoolManager(store, "ns", ["tp0"]).lookup([b"h"]) == 0


@pytest.fixture()
def pool(tmp_path):
    require_mooncake_libraries()
    from vllm_npu.kv.pool.launch import start_pool

    p = start_pool("127.0.0.1", free_port(), free_port(), free_port(), 64 << 20, tmp_path)
    yield p
    p.stop()


def _cfg(pool) -> Any:
    return pool_config({**STORE, "master_server_address": pool.master_address, "local_buffer_size": 16 << 20}, {})


def _gqa_cache(blocks: int = 6) -> torch.Tensor:
    return torch.randn(2, blocks, 4, 2, 8)  # (K/V, blocks, block_size, kv_heads, head_size)


def test_round_trip_lookup_and_a_dead_master(pool) -> None:
    cfg = _cfg(pool)
    src, dst = _gqa_cache(), torch.zeros(2, 6, 4, 2, 8)
    writer = PoolWorker(lambda: PoolStore(cfg, 0, "writer"), "ns", 0, None)
    writer.register_kv_caches({"layer.0": src})
    hashes = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32]
    assert writer.save(hashes[:2], [4, 1]) == (2, 0)
    assert writer.save(hashes[:2], [4, 1]) == (0, 0)  # already in the pool: skipped

    manager = PoolManager(PoolStore(cfg, 0, "scheduler"), "ns", parts(1, False))
    assert manager.lookup(hashes) == 2
    assert manager.lookup([hashes[2], hashes[0]]) == 0  # a prefix: stops at the first miss
    assert PoolManager(manager.store, "ns", parts(2, False)).lookup(hashes) == 0  # TP=2 needs both ranks' parts
    assert PoolManager(manager.store, "other", parts(1, False)).lookup(hashes) == 0  # another deployment

    reader = PoolWorker(lambda: PoolStore(cfg, 0, "reader"), "ns", 0, None)
    reader.register_kv_caches({"layer.0": dst})
    assert reader.load(hashes[:2], [0, 5]) == (True, 2 * writer.block_bytes)
    assert torch.equal(dst[:, 0], src[:, 4]) and torch.equal(dst[:, 5], src[:, 1])
    assert reader.load(hashes[1:], [2, 3])[0] is False  # one block missing: the whole load fails

    pool.master.kill()
    pool.master.wait()
    start = time.monotonic()
    assert manager.lookup(hashes) == 0
    assert reader.load(hashes[:1], [0])[0] is False
    assert writer.save([b"\x09" * 32], [0]) == (0, 1)
    assert time.monotonic() - start < 15
    for w in (writer, reader):
        w.shutdown()


def test_mla_latent_cache_is_stored_once_and_loaded_by_every_rank(pool) -> None:
    cfg = _cfg(pool)
    lora, rope = 8, 4
    src = torch.randn(5, 4, lora + rope)  # npu-attention's MLA cache: (blocks, block_size, latent + rope)
    ranks = [PoolWorker(lambda r=r: PoolStore(cfg, 0, f"tp{r}"), "ns", r, lora) for r in range(2)]
    for w in ranks:
        w.register_kv_caches({"layer.0": src if w.tp_rank == 0 else torch.zeros_like(src)})
    assert all(w.replicated for w in ranks)
    assert ranks[1].save([b"\x05" * 32], [2]) == (0, 0)  # rank 1 leaves the shared blocks to rank 0
    assert ranks[0].save([b"\x05" * 32], [2]) == (1, 0)
    manager = PoolManager(PoolStore(cfg, 0, "scheduler"), "ns", parts(2, True))
    assert manager.lookup([b"\x05" * 32]) == 1
    dst = torch.zeros_like(src)
    reader = PoolWorker(lambda: PoolStore(cfg, 0, "reader"), "ns", 1, lora)
    reader.register_kv_caches({"layer.0": dst})
    assert reader.load([b"\x05" * 32], [4])[0]
    # both planes of block 2 (latent run, then rope run of the one buffer) arrived in block 4
    flat_src, flat_dst, nb, bs = src.view(-1), dst.view(-1), 5, 4
    assert torch.equal(flat_dst[4 * bs * lora : 5 * bs * lora], flat_src[2 * bs * lora : 3 * bs * lora])
    rope_at = nb * bs * lora
    assert torch.equal(
        flat_dst[rope_at + 4 * bs * rope : rope_at + 5 * bs * rope],
        flat_src[rope_at + 2 * bs * rope : rope_at + 3 * bs * rope],
    )
    for w in (*ranks, reader):
        w.shutdown()


def test_key_parts() -> None:
    assert parts(2, False) == ["tp0", "tp1"] and parts(4, True) == ["mla"]
    assert block_key("ns", b"\xab", "tp1") == "vllm-npu/ns/ab/tp1"


# --- worker bookkeeping ----------------------------------------------------------------------------------------


class _FakeStore:
    available = True

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def register(self, ptr: int, nbytes: int) -> bool:
        return True

    def exists(self, keys: list[str]) -> list[bool]:
        return [k in self.objects for k in keys]

    def put(self, keys, addrs, sizes) -> list[int]:
        for k, s in zip(keys, sizes):
            self.objects[k] = b"\0" * sum(s)
        return [0] * len(keys)

    def get(self, keys, addrs, sizes) -> list[int]:
        return [len(self.objects[k]) if k in self.objects else -704 for k in keys]

    def close(self) -> None:
        pass


def _drain(worker: PoolWorker, finished: set[str]) -> tuple[set[str], set[str]]:
    for pool in (worker._loads, worker._stores):
        pool.submit(lambda: None).result()  # the background jobs before it are done
    sending, recving = worker.get_finished(finished)
    return sending or set(), recving or set()


def test_finished_request_is_released_after_its_stores_and_failed_loads_are_reported() -> None:
    from vllm.v1.kv_offload.mediums import GPULoadStoreSpec

    worker = PoolWorker(_FakeStore, "ns", 0, None)
    worker.register_kv_caches({"layer.0": _gqa_cache()})
    worker.start_store({"r1": (GPULoadStoreSpec([1, 2]), PoolLoadStoreSpec([b"a", b"b"]))})
    assert _drain(worker, set()) == (set(), set())  # stores done, request still running: nothing to free
    assert _drain(worker, {"r1", "r-other"}) == ({"r1"}, set())  # only requests with stores are reported
    assert _drain(worker, {"r1"}) == (set(), set())  # and only once

    worker.start_load({"r2": (PoolLoadStoreSpec([b"a", b"b"]), GPULoadStoreSpec([3, 4]))})
    worker.start_load({"r3": (PoolLoadStoreSpec([b"a", b"zz"]), GPULoadStoreSpec([3, 4]))})
    assert _drain(worker, set()) == (set(), {"r2", "r3"})
    stats = worker.take_stats()
    assert stats is not None and stats.data["failed"] == ["r3"] and stats.data["loaded_blocks"] == 2
    assert stats.data["stored_blocks"] == 2 and stats.reduce()["failed loads"] == 1
    worker.shutdown()


# --- vllm-npu kv-pool ------------------------------------------------------------------------------------------


def test_parse_size() -> None:
    from vllm_npu.kv.pool.cli import parse_size

    assert parse_size("16GB") == 16 << 30 and parse_size("512mb") == 512 << 20 and parse_size("1024") == 1024
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_kv_pool_command_serves_a_pool_until_terminated(tmp_path) -> None:
    import signal
    import subprocess
    import sys

    require_mooncake_libraries()
    config = tmp_path / "mooncake.json"
    ports = [str(free_port()) for _ in range(3)]
    cmd = [sys.executable, "-m", "vllm_npu.platform.tools.cli", "kv-pool", "--port", ports[0], "--metrics-port"]
    cmd += [ports[1], "--client-port", ports[2], "--segment-size", "64MB", "--config-out", str(config)]
    cmd += ["--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("KV pool up: master 127.0.0.1:" + ports[0]), (line, proc.stderr and proc.stderr.read())
        cfg = pool_config({"mooncake_config_path": str(config), "local_buffer_size": 16 << 20}, {})
        store = PoolStore(cfg, 0, "cli-test")
        assert store.available
        buf = torch.arange(64, dtype=torch.float32)
        assert store.register(buf.data_ptr(), buf.nbytes)
        assert store.put(["k"], [[buf.data_ptr()]], [[256]]) == [0] and store.exists(["k"]) == [True]
        store.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_kv_pool_command_refuses_bad_flags(capsys) -> None:
    from vllm_npu.kv.pool.cli import main

    assert main(["--segment-size", "huge"]) == 2 and "--segment-size" in capsys.readouterr().err
    assert main(["--port", "70000"]) == 2 and "--port" in capsys.readouterr().err
