# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The KV pool as the engine tests and benchmarks run it: a real ``mooncake_master`` and a memory-lending
``mooncake_client`` on 127.0.0.1 (``vllm_npu.kv.pool.launch``), the connector configuration an instance needs to
reach it, and the two-instance run most pool tests make: instance A serves the prompts and stops, a fresh instance B
serves them again and should find most of each prompt in the pool."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npu_testkit.engine import emulated_env, engine, greedy_outputs
from npu_testkit.serve import free_port
from npu_testkit.system_libs import require_mooncake_libraries

if TYPE_CHECKING:
    from vllm_npu.kv.pool.launch import PoolProcesses

#: Bytes the lending client puts into the pool unless a test needs more.
POOL_BYTES = 128 << 20


def store_config(master: str, **extra: object) -> dict[str, object]:
    """``kv_connector_extra_config`` of a ``MooncakeStoreConnector`` on this host reaching the master at ``master``
    (``host:port``). The instance lends no memory (``global_segment_size`` 0): the pool is the lending client's and
    outlives the instances. ``extra`` adds or overrides keys."""
    return {
        "master_server_address": master,
        "local_hostname": "127.0.0.1",
        "global_segment_size": 0,
        "local_buffer_size": 16 << 20,
        **extra,
    }


def pool_transfer_config(master: str) -> dict[str, object]:
    """A whole ``kv_transfer_config`` for an instance that both stores to and loads from the pool at ``master``."""
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": store_config(master),
    }


@contextlib.contextmanager
def local_pool(tmp: Path, pool_bytes: int = POOL_BYTES) -> Iterator[PoolProcesses]:
    """A master and a lending client on free ports of 127.0.0.1 for the block (logs under ``tmp``). A machine
    without the Mooncake libraries fails here with the apt line that installs them."""
    require_mooncake_libraries()
    from vllm_npu.kv.pool.launch import running_pool

    with running_pool("127.0.0.1", free_port(), free_port(), free_port(), pool_bytes, tmp) as pool:
        yield pool


def fresh_instance_runs(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    tmp: Path,
    env_extra: dict[str, str] | None = None,
    **engine_kwargs: Any,
) -> dict[str, list[int] | list[list[int]]]:
    """Instance A serves ``prompts`` greedily through a fresh pool and stops; a fresh instance B serves them again.

    Returns ``{"a": tokens, "a_cached": cached, "b": tokens, "b_cached": cached}``: per prompt, the generated token
    ids and vLLM's ``num_cached_tokens`` (A starts from an empty pool, so its counts say what the device cache alone
    gave). Each instance runs in its own process environment under ``tmp/<name>``, hash seed 0 so both compute the
    same block hashes; ``engine_kwargs`` go to both engines (prefix caching is on: the pool's hits are reported
    through it)."""
    out: dict[str, list[int] | list[list[int]]] = {}
    with local_pool(tmp) as pool:
        kv = pool_transfer_config(pool.master_address)
        for name in ("a", "b"):
            env = emulated_env(tmp / name, extra={"PYTHONHASHSEED": "0", **(env_extra or {})})
            with engine(model, env, enable_prefix_caching=True, kv_transfer_config=kv, **engine_kwargs) as llm:
                outs = greedy_outputs(llm, prompts, max_tokens)
            out[name] = [list(o.outputs[0].token_ids) for o in outs]
            out[name + "_cached"] = [o.num_cached_tokens for o in outs]
    return out
