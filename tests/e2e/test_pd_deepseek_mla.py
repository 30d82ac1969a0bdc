# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""1P1D with a tiny DeepSeek-V3 (MLA) on the emulated device: the two-plane latent cache (nope latent plane, then
rope-key plane) moves between a prefill and a decode instance over Mooncake TCP, through ``vllm-npu pd-proxy``.
One pair of instances for the module. References: HF float32 greedy and the decode instance's own greedy."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
from npu_testkit.engine import emulated_env, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.serve import vllm_server
from npu_testkit.sibling import import_sibling
from npu_testkit.system_libs import require_mooncake_libraries

pd = import_sibling(__file__, "pd_support")

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
LENGTHS = [3, 16, 33, 100]


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("deepseek_v3"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=5)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    require_mooncake_libraries()  # the Mooncake engine's system libraries, or the apt line that installs them
    tmp = tmp_path_factory.mktemp("pd_mla")
    common = [str(tiny_model), "--dtype", "float32", "--max-model-len", "512", "--block-size", "16"]
    common += ["--max-num-seqs", "8", "--served-model-name", "tiny", "--enable-prompt-tokens-details"]
    producer = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_port": pd.port_block(1)}
    consumer = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, cfg in (("prefill", producer), ("decode", consumer)):
            env = {**os.environ, **emulated_env(tmp / name, multiprocessing=True)}
            args = [*common, "--kv-transfer-config", json.dumps(cfg)]
            urls[name] = stack.enter_context(vllm_server(args, env, tmp / f"{name}.log"))
        urls["proxy"] = stack.enter_context(pd.proxy([urls["prefill"]], [urls["decode"]], tmp / "proxy.log"))
        yield urls


def test_mla_1p1d_equals_hf_and_single_instance(cluster, tiny_model, prompts):
    references = hf_greedy(tiny_model, prompts, MAX_TOKENS)
    for prompt, want in zip(prompts, references):
        status, out = pd.post(f"{cluster['proxy']}/v1/completions", pd.completion(prompt, max_tokens=MAX_TOKENS))
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want, len(prompt)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        status, alone = pd.post(f"{cluster['decode']}/v1/completions", pd.completion(prompt, max_tokens=MAX_TOKENS))
        assert status == 200 and alone["choices"][0]["token_ids"] == want

    def poke() -> None:
        pd.post(f"{cluster['prefill']}/v1/completions", pd.completion(prompts[0], max_tokens=1))

    assert pd.wait_usage_zero(cluster["prefill"], poke) == 0.0
    assert pd.kv_usage(cluster["decode"]) == 0.0


def test_mla_chat(cluster):
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    status, direct = pd.post(f"{cluster['decode']}/v1/chat/completions", body)
    assert status == 200
    status, proxied = pd.post(f"{cluster['proxy']}/v1/chat/completions", body)
    assert status == 200, proxied
    assert proxied["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
