# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""bge-m3-shaped dense embeddings (tiny ``XLMRobertaModel``: CLS pooling + normalize, ``<pad>`` = 1 so RoBERTa's
position ids start at 2) through ``LLM.embed`` on the emulated device, in vLLM's default configuration for a pooling
model: PIECEWISE graphs (the default on an NPU too), no chunked prefill (CLS pooling and bidirectional attention).

- embeddings == HF ``XLMRobertaModel``'s CLS state, normalised (cosine >= 0.9999), long and short inputs in one
  batch, as token ids and as text;
- many sequential short requests, each padded to a graph size: without the model runner zeroing the padding
  positions, RoBERTa's in-place offset grows the stale padding slots by 2 per step and the engine dies with
  ``IndexError`` in the position embedding after about 250 requests here (vllm#37868);
- the token-type decode inside the captured embedding layer is npu-patches' shift-free one;
- bad input: generate on an embedding model, an input over ``max_model_len``: a clear error, the engine unharmed.
"""

from __future__ import annotations

import pytest
from npu_testkit import pooling
from npu_testkit.engine import emulated_env, engine, make_prompts, token_prompts

pytestmark = pytest.mark.engine

KIND = "xlmr_embed"
#: Content lengths (CLS and </s> added): from 1 to a full 510-token input, mixed in one batch.
LENGTHS = [1, 7, 33, 120, 510]


@pytest.fixture(scope="module")
def model_dir():
    return pooling.build(KIND)


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    with engine(model_dir, emulated_env(tmp_path_factory.mktemp("xlmr_embed")), **pooling.llm_kwargs(KIND)) as llm:
        yield llm


def _wrapped(prompts: list[list[int]]) -> list[list[int]]:
    return [[0, *p, 2] for p in prompts]  # <s> ... </s>, as the tokenizer frames a text


def _embed(llm, prompts):
    import torch

    return [torch.tensor(o.outputs.embedding) for o in llm.embed(token_prompts(prompts), use_tqdm=False)]


def _check_matches_hf(llm, model_dir, prompts) -> None:
    got = _embed(llm, prompts)
    cosines = pooling.cosines(got, pooling.hf_embeddings(model_dir, KIND, prompts))
    assert min(cosines) >= 0.9999, cosines


def test_default_pooling_config_runs_piecewise_graphs(llm):
    cfg = llm.llm_engine.vllm_config
    assert cfg.model_config.pooler_config.pooling_type == "CLS"
    assert not cfg.scheduler_config.chunked_prefill_enabled
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["cudagraph_mode"] == "PIECEWISE", info["cudagraph_mode"]
    # vLLM wraps our backend for encoder-only attention (EncoderOnlyAttention_AscendAttentionBackend)
    assert [b.rsplit("_", 1)[-1] for b in info["attention_backends"]] == ["AscendAttentionBackend"], info


def test_embeddings_match_hf_mixed_lengths_in_one_batch(llm, model_dir):
    prompts = _wrapped(make_prompts(LENGTHS, seed=4, vocab_size=500, avoid=(0, 1, 2, 3)))
    _check_matches_hf(llm, model_dir, prompts)
    got = _embed(llm, prompts)
    assert max(pooling.cosines(got[1:], got[:-1])) < 0.99  # different inputs, clearly different embeddings


def test_text_inputs_match_hf(llm, model_dir):
    texts = ["What is the capital of the land?", "It was the best of times, it was the worst of times. " * 6]
    got = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    ids = [pooling.text_ids(model_dir, t) for t in texts]
    assert ids[0][0] == 0 and ids[0][-1] == 2
    import torch

    cosines = pooling.cosines([torch.tensor(g) for g in got], pooling.hf_embeddings(model_dir, KIND, ids))
    assert min(cosines) >= 0.9999, cosines


def test_embedding_layer_decodes_token_types_without_shifts(llm):
    from vllm_npu.patches import patch_report

    (report,) = llm.collective_rpc(patch_report)
    assert report["roberta-token-types-no-shift"]["installed"] is True, report["roberta-token-types-no-shift"]


def test_generate_on_an_embedding_model_is_a_clear_error(llm, model_dir):
    with pytest.raises(ValueError, match="only supported for generative models.*--runner generate"):
        llm.generate(["hello"])
    _check_matches_hf(llm, model_dir, _wrapped(make_prompts([5], seed=2, vocab_size=500, avoid=(0, 1, 2, 3))))


def test_input_over_max_model_len_is_a_clear_error(llm, model_dir):
    too_long = _wrapped(make_prompts([pooling.MAX_LEN], seed=3, vocab_size=500, avoid=(0, 1, 2, 3)))
    with pytest.raises(ValueError, match=f"longer than the maximum model length of {pooling.MAX_LEN}"):
        llm.embed(token_prompts(too_long), use_tqdm=False)
    _check_matches_hf(llm, model_dir, _wrapped(make_prompts([5], seed=2, vocab_size=500, avoid=(0, 1, 2, 3))))


def test_many_padded_steps_keep_positions_in_range(llm, model_dir):
    # Last in the module: without the runner fix the in-process engine dies here, and later tests would wait on it.
    # A 3-token input runs padded to the graph size 4; the padding slot's position would grow by 2 per step.
    (prompt,) = _wrapped(make_prompts([1], seed=9, vocab_size=500, avoid=(0, 1, 2, 3)))
    steps = pooling.MAX_LEN // 2 + 20
    for _ in range(steps):
        (out,) = llm.embed(token_prompts([prompt]), use_tqdm=False)
    _check_matches_hf(llm, model_dir, [prompt])
