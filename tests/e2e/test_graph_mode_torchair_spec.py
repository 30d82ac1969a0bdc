# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Speculative decoding in ``npu.graph_mode='torchair'``: the target's verification steps compiled, k = 1..3, MLA
and GQA (compile cache off, KV block 128). One engine per case:

- ``mtp-k1`` / ``mtp-k3``: DeepSeek MTP on a tiny DeepSeek-V3 with an MTP layer (MLA; random MTP weights, so the
  drafts are almost never accepted and every verification step rejects);
- ``eagle-k2``: EAGLE on a tiny Llama (GQA) with the EAGLE-1 head of ``test_spec_decode_eagle`` (trained on the
  target's greedy outputs, cached by content), whose drafts are often accepted: accepted tokens were verified by
  graph rows that saw the drafts before them.

vLLM dispatches uniform verification steps (``1 + k`` tokens per request, every request a decode) to the compiled
sizes (``cudagraph_capture_sizes`` below: 1, 2 and 4 requests' worth), as FULL_DECODE_ONLY does on CUDA; the
metadata lays them out one graph row per token (``GraphDecodeInputs.per_token``), so the verification runs inside
the compiled graph with the single-token decode kernels. The draft model's passes run compiled too where they are
pure decode passes (``DraftTorchairWrapper``: each size compiled at its first such pass). Rejection sampling stays
lossless: greedy output equals HF's target alone for batches of 1..4 requests (3 pads to the 4-request size), with
verification steps run compiled, no compile after start-up and no opaque attention node.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from npu_testkit.drafts import build_mtp_model, train_eagle_head
from npu_testkit.engine import make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.spec_e2e import greedy_counted, mixed_prompts, spec_engine

pytestmark = pytest.mark.engine

NEW_TOKENS = 24


@dataclass(frozen=True)
class Case:
    method: str
    k: int

    @property
    def sizes(self) -> list[int]:
        q = 1 + self.k
        return [q, 2 * q, 4 * q]


CASES = {"mtp-k1": Case("deepseek_mtp", 1), "mtp-k3": Case("deepseek_mtp", 3), "eagle-k2": Case("eagle", 2)}


def _eagle_target_and_head():
    # test_spec_decode_eagle's target and head (same arguments: the builds are shared through the content cache)
    target = build_tiny_model(tiny_config("llama", num_hidden_layers=8), std=0.1)
    prompts = mixed_prompts() + make_prompts([4, 9, 17, 25, 33, 48, 70, 90], seed=40)
    return target, train_eagle_head(target, prompts, 64, steps=300)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def started(request, tmp_path_factory):
    case = CASES[request.param]
    if case.method == "eagle":
        target, head = _eagle_target_and_head()
        spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": case.k}
    else:
        target = build_mtp_model(tiny_config("deepseek_v3"), std=0.2)
        spec = {"method": "deepseek_mtp", "num_speculative_tokens": case.k}
    npu = {"graph_mode": "torchair", "torchair_cache": False}
    kwargs = {"compilation_config": {"cudagraph_capture_sizes": case.sizes}, "block_size": 128}
    tmp = tmp_path_factory.mktemp(f"torchair_{request.param}")
    with spec_engine(target, tmp, spec, additional_config={"npu": npu}, **kwargs) as llm:
        (info,) = llm.collective_rpc("npu_runtime_info")
        yield case, target, llm, info["torchair"]


def _torchair(llm) -> dict:
    (info,) = llm.collective_rpc("npu_runtime_info")
    return info["torchair"]


def test_verification_sizes_are_compiled_at_start_up(started):
    case, _, llm, startup = started
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["cudagraph_mode"] == "FULL_DECODE_ONLY" and info["reorder_batch_threshold"] == 1 + case.k
    assert info["drafter"] == "vllm.v1.spec_decode.eagle.EagleProposer"
    backend = "mla.AscendMLABackend" if case.method == "deepseek_mtp" else "gqa.AscendAttentionBackend"
    assert info["attention_backends"] == [f"vllm_npu.attention.backends.{backend}"]
    assert startup["compiles"] == dict.fromkeys(case.sizes, 1) and startup["recompiles"] == 0, startup
    assert startup["opaque_attention_nodes"] == 0, startup  # attention in every compiled graph


def test_verification_in_the_graph_is_lossless_against_the_target_alone(started):
    case, target, llm, _ = started
    drafted = accepted = 0
    batched: dict[int, int] = {}  # n -> compiled runs at the size of n requests' verification steps
    for n in (1, 2, 3, 4):
        prompts = make_prompts([5 + 7 * i for i in range(n)], seed=20 + n)
        before = _torchair(llm)
        got = greedy_counted(llm, prompts, NEW_TOKENS)
        after = _torchair(llm)
        assert got.tokens == hf_greedy(target, prompts, NEW_TOKENS), f"{n} requests"
        drafted, accepted = drafted + got.drafted, accepted + got.accepted
        runs = {s: after["compiled_calls"].get(s, 0) - before["compiled_calls"].get(s, 0) for s in case.sizes}
        batched[n] = runs[min(s for s in case.sizes if s >= n * (1 + case.k))]
        assert sum(runs.values()) > 0, (n, runs)  # verification steps ran through compiled sizes
        assert after["compiles"] == before["compiles"] and after["recompiles"] == before["recompiles"], after
    # The engine core (its own process) starts stepping when the first request arrives, so on a loaded host the
    # requests of one call may not all share a step (one clean-clone run saw n=2 run one request at a time); the
    # steps that did batch several requests ran through the larger compiled sizes.
    assert batched[1] > 0 and any(batched[n] > 0 for n in (2, 3, 4)), batched
    assert drafted > 0
    served = _torchair(llm)  # the draft's decode passes ran compiled too: each size compiled once, at first use
    assert sum(served["draft_compiled_calls"].values()) > 0, served
    assert set(served["draft_compiles"]) <= set(case.sizes), served
    assert all(n == 1 for n in served["draft_compiles"].values()), served
    if case.method == "eagle":  # the trained head: accepted drafts, verified inside the graph
        assert accepted > 0, (drafted, accepted)
