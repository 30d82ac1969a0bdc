# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""1P1D with a tiny DeepSeek-V3 (MLA) on the emulated device: the two-plane latent cache (nope latent plane, then
rope-key plane) moves between a prefill and a decode instance over Mooncake TCP, through ``vllm-npu pd-proxy``.
One pair of instances for the module. References: HF float32 greedy and the decode instance's own greedy.

The decode instance runs ``npu.graph_mode='torchair'`` (as vllm-ascend's DeepSeek PD deployments run their decode
nodes; the prefill instance eager): the Mooncake connector's pulls run around the compiled step (its per-layer
hooks are empty, so nothing of it is in the graph), and the pulled requests' decode steps run compiled (read from
the instance's ``npu_runtime_info`` through vLLM's dev-mode ``/collective_rpc``).

Both instances serve DeepSeek MTP (k=1; the checkpoint's MTP layer drafts from a bigram table of the references,
:mod:`npu_testkit.mtp_bigram`, so drafts are accepted): the decode node's verification steps (2 tokens per request)
run at its compiled sizes [2, 4, 8] and its draft passes compiled too. A pulled request's first decode step carries
no drafts (1 token: not a uniform verification step), so it runs eagerly; the later steps run compiled."""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest
from npu_testkit.drafts import build_mtp_model
from npu_testkit.engine import emulated_env, make_prompts, tiny_config
from npu_testkit.models import hf_greedy
from npu_testkit.mtp_bigram import bigrams, teach_bigrams
from npu_testkit.serve import free_port, vllm_server
from npu_testkit.sibling import import_sibling
from npu_testkit.system_libs import require_mooncake_libraries

pd = import_sibling(__file__, "pd_support")

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
SIZES = [2, 4, 8]  # the decode instance's compiled sizes: 1, 2 and 4 requests' verification steps (k = 1)
MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 1}
LENGTHS = [3, 16, 33, 100]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=5)


@pytest.fixture(scope="module")
def tiny_model(prompts, tmp_path_factory):
    """The tiny DeepSeek-V3 with an MTP layer taught the bigrams of the first half of its greedy continuations (a
    copy: the built checkpoint is shared through the content cache)."""
    model = tmp_path_factory.mktemp("mtp") / "deepseek_v3_mtp"
    shutil.copytree(build_mtp_model(tiny_config("deepseek_v3")), model)
    references = hf_greedy(model, prompts, MAX_TOKENS)
    teach_bigrams(model, bigrams(prompts, [out[: MAX_TOKENS // 2] for out in references]))
    return model


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    require_mooncake_libraries()  # the Mooncake engine's system libraries, or the apt line that installs them
    tmp = tmp_path_factory.mktemp("pd_mla")
    common = [str(tiny_model), "--dtype", "float32", "--max-model-len", "512", "--block-size", "16"]
    common += ["--max-num-seqs", "8", "--served-model-name", "tiny", "--enable-prompt-tokens-details"]
    common += ["--speculative-config", json.dumps(MTP)]
    producer = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_port": free_port()}
    consumer = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}
    torchair = {"npu": {"graph_mode": "torchair", "torchair_cache": False}}
    extra = {
        "prefill": [],
        "decode": [
            *("--additional-config", json.dumps(torchair)),
            *("--compilation-config", json.dumps({"cudagraph_capture_sizes": SIZES})),
        ],
    }
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, cfg in (("prefill", producer), ("decode", consumer)):
            env = {**os.environ, **emulated_env(tmp / name, multiprocessing=True), "VLLM_SERVER_DEV_MODE": "1"}
            args = [*common, "--kv-transfer-config", json.dumps(cfg), *extra[name]]
            urls[name] = stack.enter_context(vllm_server(args, env, tmp / f"{name}.log"))
        urls["proxy"] = stack.enter_context(pd.proxy([urls["prefill"]], [urls["decode"]], tmp / "proxy.log"))
        yield urls


def _torchair(url: str) -> dict:
    status, out = pd.post(f"{url}/collective_rpc", {"method": "npu_runtime_info"})
    assert status == 200, out
    (info,) = out["results"]
    return info["torchair"]


def _spec_counter(url: str, name: str) -> float:
    """A spec-decode counter of the instance's /metrics (0 before its first verification step)."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))


def test_mla_1p1d_equals_hf_and_single_instance(cluster, tiny_model, prompts):
    references = hf_greedy(tiny_model, prompts, MAX_TOKENS)
    drafted = _spec_counter(cluster["decode"], "num_draft_tokens")
    accepted = _spec_counter(cluster["decode"], "num_accepted_tokens")
    before = _torchair(cluster["decode"])
    assert sorted(int(s) for s in before["compiles"]) == SIZES and before["recompiles"] == 0, before
    for prompt, want in zip(prompts, references):
        status, out = pd.post(f"{cluster['proxy']}/v1/completions", pd.completion(prompt, max_tokens=MAX_TOKENS))
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want, len(prompt)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        # the pulled request's verification steps ran compiled (its first step, without drafts, eagerly), the
        # draft's passes too; nothing recompiled
        served = _torchair(cluster["decode"])
        assert served["compiled_calls"].get("2", 0) > before["compiled_calls"].get("2", 0), served
        assert served["eager_calls"] > before["eager_calls"], served
        assert sum(served["draft_compiled_calls"].values()) > sum(before["draft_compiled_calls"].values()), served
        assert served["compiles"] == before["compiles"] and served["recompiles"] == 0, served
        before = served
        status, alone = pd.post(f"{cluster['decode']}/v1/completions", pd.completion(prompt, max_tokens=MAX_TOKENS))
        assert status == 200 and alone["choices"][0]["token_ids"] == want

    # the decode node verified drafts of pulled and direct requests: accepted and rejected
    drafted = _spec_counter(cluster["decode"], "num_draft_tokens") - drafted
    accepted = _spec_counter(cluster["decode"], "num_accepted_tokens") - accepted
    assert 0 < accepted < drafted, (drafted, accepted)

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
