# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""C8 (int8 KV cache) end to end: a tiny bf16 Qwen2 (GQA: 4 heads, 2 KV heads of 16) quantized by ``vllm-npu
quantize --scheme W8A8_DYNAMIC --kv-cache C8`` (msModelSlim's spelling: ``kv_cache_type`` C8, per-channel
``k/v_proj.kv_cache_scale``) served through real vLLM 0.11 on the emulated device, ``cudagraph_mode=FULL_DECODE_ONLY``
(pure decode batches of up to 8 requests replay captured graphs, every other step runs eagerly), KV blocks of 32
tokens, a 64-token step budget (longer prompts are prefilled in chunks) and prefix caching.

Reference: ``vllm_npu.quant.tools.simulate`` (HF transformers float32, the W8A8_DYNAMIC maths from the checkpoint
tensors, and every key after RoPE / value the attention reads rounded to the int8 grid of the layer's scales).
Tolerance: next-token log-probs over the whole vocabulary within ``LOGPROB_ATOL`` of the simulation's, in every
state; greedy tokens equal the simulation's. The engine serves float32 (exact comparisons); the capacity check
compares the int8 pages with the bf16 (and float32) pages of the same layers at the same budget, through vLLM's own
KV-cache sizing.
"""

from __future__ import annotations

import logging
import re

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, greedy_outputs, make_prompts, tiny_config, token_prompts
from npu_testkit.graph_e2e import CAPTURE_SIZES, replays

pytestmark = pytest.mark.engine

BLOCK = 32
NEW_TOKENS = 8
#: Max |engine - simulation| over the next-token log-probs (nats; measured 2e-6). The int8 grid is the same on both
#: sides; what differs is float32 rounding of the K/V before quantization (vLLM's and HF's RoPE, matmul orders), which
#: can move a value across a rounding boundary of one channel: one int8 step. The other quant e2e modules use 1e-3
#: too; halving the K scales of the write (a wrong C8 path) fails every state by far more.
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from npu_testkit.models import build_tiny_model
    from vllm_npu.quant.tools.cli import main as quantize_main

    float_dir = build_tiny_model(tiny_config("qwen2"), dtype="bfloat16")
    quant_dir = tmp_path_factory.mktemp("c8") / "qwen2-w8a8-dynamic-c8"
    args = [str(float_dir), str(quant_dir), "--scheme", "W8A8_DYNAMIC", "--kv-cache", "C8"]
    assert quantize_main(args) == 0
    return float_dir, quant_dir


@pytest.fixture(scope="module")
def simulated(checkpoints):
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    return simulated_hf_model(checkpoints[1])


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def started(checkpoints, tmp_path_factory):
    """(engine, the KV-sizing log lines of its start)."""
    sizing = logging.getLogger("vllm.v1.core.kv_cache_utils")
    handler = _Lines()
    sizing.addHandler(handler)
    kwargs = {
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": CAPTURE_SIZES},
        "block_size": BLOCK,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": True,
        "max_logprobs": -1,
    }
    try:
        with engine(checkpoints[1], emulated_env(tmp_path_factory.mktemp("vllm")), **kwargs) as llm:
            start_lines = list(handler.lines)
            sizing.removeHandler(handler)
            yield llm, start_lines
    finally:
        sizing.removeHandler(handler)


@pytest.fixture(scope="module")
def llm(started):
    return started[0]


def _attention_state(worker):
    """Inside the worker: the KV caches' dtypes and every attention layer's quant method and scale shapes."""
    from vllm.attention.layer import Attention

    model = worker.model_runner.get_model()
    layers = {
        name: (type(m.quant_method).__name__, tuple(m.key_antiquant_scale.shape), tuple(m.value_antiquant_scale.shape))
        for name, m in model.named_modules()
        if isinstance(m, Attention)
    }
    return sorted({str(t.dtype) for t in worker.model_runner.kv_caches}), layers


def _capacity(worker):
    """Inside the worker: KV blocks vLLM's own sizing gives these layers at the engine's budget, per cache dtype."""
    import dataclasses

    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm_npu.platform.worker import emulated_kv_cache_bytes

    specs = worker.model_runner.get_kv_cache_spec()
    budget = emulated_kv_cache_bytes(worker.vllm_config.additional_config)

    def blocks(dtype):
        respec = {name: dataclasses.replace(spec, dtype=dtype) for name, spec in specs.items()}
        return get_kv_cache_configs(worker.vllm_config, [respec], [budget])[0].num_blocks

    return {"spec": sorted({str(s.dtype) for s in specs.values()}), "budget": budget,
            **{str(d).removeprefix("torch."): blocks(d) for d in (torch.int8, torch.bfloat16, torch.float32)}}  # fmt: skip


def _next_logprobs(llm, prompts):
    import torch
    from vllm import SamplingParams

    outs = llm.generate(
        token_prompts(prompts), SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1), use_tqdm=False
    )
    result = []
    for out in outs:
        lp = torch.full((512,), float("-inf"))
        for token, logprob in out.outputs[0].logprobs[0].items():
            lp[token] = logprob.logprob
        result.append((lp, out.num_cached_tokens))
    return result


def _close(got, sim, what: str) -> None:
    diff = float((got - sim[: got.shape[0]]).abs().max())
    assert diff <= LOGPROB_ATOL, f"{what}: max |engine - simulation| log-prob {diff:.2e} > {LOGPROB_ATOL}"


def test_int8_cache_and_c8_method_on_every_attention_layer(llm):
    ((dtypes, layers),) = llm.collective_rpc(_attention_state)
    assert dtypes == ["torch.int8"]
    assert len(layers) == 2
    assert set(layers.values()) == {("AscendC8KVCacheMethod", (32,), (32,))}


def test_prefill_without_cache_matches_simulation(llm, simulated):
    from vllm_npu.quant.tools.simulate import logprobs

    prompts = make_prompts([1, 5, 20, 33], seed=41)
    for prompt, (got, cached) in zip(prompts, _next_logprobs(llm, prompts)):
        assert cached == 0
        _close(got, logprobs(simulated, prompt)[-1], f"{len(prompt)}-token prefill")


def test_prefix_cache_hit_matches_simulation(llm, simulated):
    from vllm_npu.quant.tools.simulate import logprobs

    prefix = make_prompts([2 * BLOCK + 5], seed=42)[0]
    first, second = prefix + [7, 8, 9], prefix + [21, 22, 23, 24]
    _next_logprobs(llm, [first])
    ((got, cached),) = _next_logprobs(llm, [second])
    assert cached >= 2 * BLOCK, cached  # the shared blocks came from the int8 cache
    _close(got, logprobs(simulated, second)[-1], "prefix-cache hit")


def test_chunked_prefill_in_mixed_batches_matches_simulation(llm, simulated):
    from vllm_npu.quant.tools.simulate import logprobs

    # 150 + 90 tokens with a 64-token step budget: both are prefilled in chunks, over steps that also decode the
    # short prompts (mixed batches), each chunk attending to the int8 pages of the earlier ones
    prompts = make_prompts([150, 3, 90, 9], seed=43)
    for prompt, (got, _) in zip(prompts, _next_logprobs(llm, prompts)):
        _close(got, logprobs(simulated, prompt)[-1], f"{len(prompt)}-token chunked / mixed prefill")


def test_decode_in_full_graphs_matches_simulation(llm, simulated):
    import torch
    from vllm import SamplingParams
    from vllm_npu.quant.tools.simulate import greedy as sim_greedy
    from vllm_npu.quant.tools.simulate import logprobs

    prompts = make_prompts([4, 17, 40], seed=44)
    before = replays(llm, "FULL")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=-1, ignore_eos=True)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert replays(llm, "FULL") > before  # decode steps replayed the captured graphs
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert tokens == sim_greedy(simulated, prompts, NEW_TOKENS)
    for prompt, out, toks in zip(prompts, outs, tokens):
        sim = logprobs(simulated, prompt + toks[:-1])
        for step, step_lp in enumerate(out.outputs[0].logprobs):
            got = torch.full((sim.shape[1],), float("-inf"))
            for token, logprob in step_lp.items():
                got[token] = logprob.logprob
            _close(got, sim[len(prompt) - 1 + step], f"decode step {step} of a {len(prompt)}-token prompt")


def test_eager_and_graph_decode_give_identical_greedy_tokens(llm):
    # Up to 8 decoding requests replay a captured graph; 9 and more run the decode eagerly (above the largest
    # capture size): the same prompts in both, token for token.
    prompts = make_prompts([3 + (5 * i) % 11 for i in range(CAPTURE_SIZES[-1] + 2)], seed=45)
    before = replays(llm, "FULL")
    graph = [greedy(llm, [p], NEW_TOKENS)[0] for p in prompts[:3]]
    assert replays(llm, "FULL") > before
    eager = greedy(llm, prompts, NEW_TOKENS)[:3]
    assert graph == eager


def test_kv_capacity_is_twice_the_bfloat16_cache_and_the_log_and_scheduler_agree(llm, started):
    (cap,) = llm.collective_rpc(_capacity)
    assert cap["spec"] == ["torch.int8"]
    engine_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    assert cap["int8"] == engine_blocks  # the sizing recomputed here is the engine's own
    ratio = cap["int8"] / cap["bfloat16"]
    assert ratio >= 1.9, cap
    assert cap["int8"] / cap["float32"] >= 3.8, cap
    sizes = (re.search(r"KV cache size: ([\d,]+) tokens", line) for line in started[1])
    logged = [int(m.group(1).replace(",", "")) for m in sizes if m]
    assert logged == [engine_blocks * BLOCK], started[1]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.kv_cache_manager.block_pool.num_gpu_blocks == engine_blocks
    print(f"C8 KV capacity: {engine_blocks * BLOCK} tokens ({cap['int8']} blocks) vs bf16 {cap['bfloat16'] * BLOCK} "
          f"tokens at {cap['budget']} bytes: ratio {ratio:.3f}")  # fmt: skip


def test_greedy_outputs_report_prefix_hits_on_int8_pages(llm):
    prefix = make_prompts([BLOCK + 1], seed=46)[0]
    greedy(llm, [prefix + [5]], 2)
    (out,) = greedy_outputs(llm, [prefix + [6, 7]], 2)
    assert out.num_cached_tokens >= BLOCK
