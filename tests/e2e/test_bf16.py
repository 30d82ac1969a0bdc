# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""bfloat16 on the emulated device stays close to HF transformers float32 (tiny Qwen2).

Metric: teacher-forced log-probabilities. For a fixed 120-token sequence, vLLM's ``prompt_logprobs`` of each actual
next token (bf16 weights, activations and KV cache) against HF float32 ``log_softmax`` at the same position:
mean |difference| < 0.06 nats and max < 0.3 nats (measured: 0.028 / 0.13). Greedy decoding in bf16 drifts from fp32
after a few tokens on random weights, so only the first generated token of every prompt (a pure prefill decision)
must equal HF's.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, token_prompts
from npu_testkit.models import hf_greedy, hf_logprobs

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_qwen2, tmp_path_factory):
    with engine(tiny_qwen2, emulated_env(tmp_path_factory.mktemp("bf16")), dtype="bfloat16") as llm:
        yield llm


def test_bf16_teacher_forced_logprobs_close_to_hf_fp32(llm, tiny_qwen2):
    import torch
    from vllm import SamplingParams

    seq = make_prompts([120], seed=9)[0]
    (out,) = llm.generate(token_prompts([seq]), SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert llm.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    ref = hf_logprobs(tiny_qwen2, seq, dtype="float32")
    diffs = torch.tensor(
        [abs(out.prompt_logprobs[i][seq[i]].logprob - float(ref[i - 1, seq[i]])) for i in range(1, len(seq))]
    )
    assert diffs.mean() < 0.06 and diffs.max() < 0.3, (float(diffs.mean()), float(diffs.max()))


def test_bf16_first_greedy_token_equals_hf_fp32(llm, tiny_qwen2, prompts):
    got = greedy(llm, prompts, 1)
    assert got == hf_greedy(tiny_qwen2, prompts, 1, dtype="float32")


def test_bf16_structured_output_json_schema(llm):
    # xgrammar's CPU bitmask takes float32 logits only: on bf16 this request used to kill the engine
    # (ValueError: logits must be of type float32, then EngineDeadError). A plain request shares the batch.
    import json

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    plain = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    done, other = llm.generate(["hi", "hello"], [structured, plain], use_tqdm=False)
    assert done.outputs[0].finish_reason == "stop", done.outputs[0]
    assert isinstance(json.loads(done.outputs[0].text)["a"], int)
    assert len(other.outputs[0].token_ids) == 5


def test_bf16_structured_output_every_kind_and_the_npu_side_of_the_mask(llm):
    # Regex, choice, EBNF and Lark grammars, and a JSON schema vLLM's auto backend hands to llguidance ("format"), on
    # bf16 logits with a plain request in the batch (the object schema with free whitespace: the test above); each
    # output valid and ended by its grammar. Then the runner masks through the NPU's side of GRAMMAR_BITMASK (bf16
    # masked on the device; here the CPU) instead of xgrammar's float32 host copy: the very same tokens.
    from npu_testkit.structured import (
        CASES,
        GUIDANCE_CASE,
        check_structured,
        check_structured_masked_per_step,
        structured_prompts,
    )
    from vllm_npu.platform.sample import GRAMMAR_BITMASK

    cases = CASES[1:] + [GUIDANCE_CASE]
    first = check_structured(llm, None, structured_prompts(), cases)
    second, _ = check_structured_masked_per_step(llm, None, mask=GRAMMAR_BITMASK.npu, cases=cases)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"regex": "[0-9"}, "invalid regex"),
        ({"choice": []}, "cannot be an empty list"),
        ({"grammar": "root ::= (("}, "Failed to convert the grammar from GBNF to Lark: Expected '\\)'"),
        # vLLM converts a Lark grammar to EBNF in place before xgrammar rejects it, so llguidance (the fallback)
        # reports on the converted text ("root ::= start / start ::= ((").
        ({"grammar": "start: (("}, "Grammar error: 1\\(7\\): Expected token"),
        ({"json": {"type": "nonsense"}}, "Invalid type: nonsense"),
        ({"json": "{not json"}, "key must be a string at line 1 column 2"),
    ],
    ids=["regex", "empty_choice", "ebnf", "lark", "schema", "schema_not_json"],
)
def test_bf16_rejected_constraint_is_a_value_error_and_the_engine_serves_on(
    llm, tiny_qwen2, prompts, constraint, message
):
    # Offline, a constraint neither xgrammar nor llguidance (vLLM's auto fallback) accepts fails the call with a
    # ValueError naming the cause, before anything reaches the engine; the next request is served as before.
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=message):
        llm.generate(["hi"], bad, use_tqdm=False)
    assert greedy(llm, prompts[:2], 1) == hf_greedy(tiny_qwen2, prompts[:2], 1, dtype="float32")
