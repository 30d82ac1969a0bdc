# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""PD + KV pool through the proxy (vLLM's ``MultiConnector``), on the emulated device, everything on 127.0.0.1: a real
``mooncake_master`` and memory-lending ``mooncake_client``; a prefill instance running ``MooncakeConnector``
(kv_producer) and ``MooncakeStoreConnector`` (the pool) side by side in a ``MultiConnector``; a decode instance
(``MooncakeConnector`` kv_consumer); ``vllm-npu pd-proxy`` in front; a second prefill instance like the first.
Tiny Qwen2 (GQA), float32, block size 16.

Through the proxy the answers == HF greedy and the decode side computes only the last prompt token (PD works with
the pool beside it); the prefill instance stored the prompts in the pool as it computed them, so the second prefill
instance, asked directly, gets each prompt's full blocks from the pool, == HF; the first prefill instance's KV usage
returns to zero (the PD hold and the pool stores both release their blocks). Both prefill instances report the pool
on vLLM's ``/metrics`` (npu-patches' ``kv-connector-metrics`` unpacks the MultiConnector's stats): the first the
blocks it stored, the second the blocks it loaded (its pool hits).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import urllib.request

import pytest
from npu_testkit.engine import emulated_env, make_prompts
from npu_testkit.kv_pool import local_pool, store_config
from npu_testkit.models import hf_greedy
from npu_testkit.serve import free_port, vllm_server
from npu_testkit.sibling import import_sibling
from npu_testkit.system_libs import require_mooncake_libraries

pd = import_sibling(__file__, "pd_support")

pytestmark = pytest.mark.engine

BLOCK = 16
LENGTHS = [150, 203]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=64)


@pytest.fixture(scope="module")
def references(tiny_qwen2, prompts) -> list[list[int]]:
    return hf_greedy(tiny_qwen2, prompts, pd.MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(tiny_qwen2, tmp_path_factory):
    require_mooncake_libraries()  # the PD connector's transfer engine, before the pool's processes
    tmp = tmp_path_factory.mktemp("pd-pool")
    common = [str(tiny_qwen2), "--dtype", "float32", "--max-model-len", "512", "--block-size", "16"]
    common += ["--max-num-seqs", "8", "--served-model-name", "tiny", "--enable-prompt-tokens-details"]
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(local_pool(tmp))
        store = store_config(pool.master_address)

        def prefill(kv_port: int) -> dict[str, object]:
            return {
                "kv_connector": "MultiConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "connectors": [
                        {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_port": kv_port},
                        {
                            "kv_connector": "MooncakeStoreConnector",
                            "kv_role": "kv_both",
                            "kv_connector_extra_config": store,
                        },
                    ]
                },
            }

        consumer = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}
        urls = {}
        for name, cfg in (
            ("prefill", prefill(free_port())),
            ("decode", consumer),
            ("prefill2", prefill(free_port())),
        ):
            env = {**os.environ, **emulated_env(tmp / name, multiprocessing=True, extra={"PYTHONHASHSEED": "0"})}
            args = [*common, "--kv-transfer-config", json.dumps(cfg)]
            urls[name] = stack.enter_context(vllm_server(args, env, tmp / f"{name}.log"))
        urls["proxy"] = stack.enter_context(pd.proxy([urls["prefill"]], [urls["decode"]], tmp / "proxy.log"))
        yield urls


def test_pd_through_the_proxy_with_the_pool_beside_it(cluster, prompts, references) -> None:
    for prompt, want in zip(prompts, references):
        status, out = pd.post(f"{cluster['proxy']}/v1/completions", pd.completion(prompt))
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want, len(prompt)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1


def test_second_prefill_instance_gets_the_prompts_from_the_pool(cluster, prompts, references) -> None:
    for prompt, want in zip(prompts, references):
        status, out = pd.post(f"{cluster['prefill2']}/v1/completions", pd.completion(prompt))
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) // BLOCK * BLOCK, len(prompt)


def test_prefill_blocks_are_released(cluster) -> None:
    def poke() -> None:
        pd.post(f"{cluster['prefill']}/v1/completions", pd.completion([5, 6, 7], max_tokens=1))

    assert pd.wait_usage_zero(cluster["prefill"], poke) == 0.0


def _pool_counter(url: str, name: str) -> float:
    """``vllm:npu_kv_pool_<name>_total`` of engine 0 on the instance's /metrics (0 while the counter is absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    pattern = rf'^vllm:npu_kv_pool_{name}_total\{{[^}}]*engine="0"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_pool_counters_on_metrics(cluster, prompts) -> None:
    full_blocks = sum(len(p) // BLOCK for p in prompts)
    # the second instance's loads were reported on the steps that answered it (stats ride on the step's output)
    assert _pool_counter(cluster["prefill2"], "hit_blocks") == full_blocks
    assert _pool_counter(cluster["prefill2"], "loaded_bytes") > 0
    assert _pool_counter(cluster["prefill2"], "failed_loads") == 0
    # the first instance's stores finish off the step; their stats reach /metrics with a later step
    deadline = time.monotonic() + 60
    while _pool_counter(cluster["prefill"], "stored_blocks") < full_blocks and time.monotonic() < deadline:
        pd.post(f"{cluster['prefill']}/v1/completions", pd.completion([5, 6, 7], max_tokens=1))
        time.sleep(0.5)
    assert _pool_counter(cluster["prefill"], "stored_blocks") >= full_blocks
    assert _pool_counter(cluster["prefill"], "stored_bytes") > 0
    assert _pool_counter(cluster["prefill"], "store_errors") == 0
