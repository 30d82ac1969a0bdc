# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Structured output end to end: one request per constraint kind vLLM 0.11 accepts, each validated by an independent
checker, and the greedy tokens of a constrained request computed without vLLM.

- :data:`CASES`: JSON schema, regex, choice, EBNF grammar and Lark grammar (vLLM converts Lark to EBNF for
  xgrammar), each a :class:`Case` with ``StructuredOutputsParams`` keywords and a checker that does not use
  xgrammar (``jsonschema``, ``re``, membership, a ``lark`` parser of the same language). :data:`GUIDANCE_CASE`: a
  JSON schema xgrammar does not support (``format``), which vLLM's ``auto`` backend hands to llguidance: its bitmask
  goes through the same masking step.
- :func:`hf_structured_greedy`: HF transformers float32 greedy decoding with xgrammar's matcher over the same
  compiled grammar vLLM's xgrammar backend builds (its tokenizer info, ``any_whitespace``, choice and Lark
  conversions): the tokens a constrained greedy request must produce, whatever masks the logits in the engine.
- :func:`check_structured`: every case (and a plain request) in one batch of ``llm``; each output valid, finished by
  the grammar, and (float32 engines) equal to :func:`hf_structured_greedy`.
- :func:`check_structured_masked_per_step` (in-process engines): :func:`check_structured` with the runner's mask
  (or another side of ``GRAMMAR_BITMASK``) recording the graph replays counted at each call.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

#: Tokens a structured request may take; every case's grammar ends well before.
MAX_TOKENS = 48
#: Engine keywords for modules that run :func:`check_structured`: JSON without free whitespace between its tokens
#: (vLLM's ``disable_any_whitespace``, which needs a named backend), because random-weight models, given the choice,
#: emit whitespace until ``max_tokens`` (the defaults are exercised by tests/e2e/test_bad_input_http.py,
#: test_serve.py and test_bf16.py).
ENGINE_KWARGS: dict[str, Any] = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
#: Prompt lengths of :func:`check_structured`'s batch: one per case of :data:`CASES`, then the plain request.
PROMPT_LENGTHS = [5, 9, 7, 11, 6, 8]

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"enum": ["x", "yy"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
EBNF = 'root ::= num ("+" num)? ("+" num)?\nnum ::= [1-9] [0-9]?'
EBNF_TWIN = 'start: NUM ("+" NUM)? ("+" NUM)?\nNUM: /[1-9][0-9]?/'
LARK = 'start: "(" item ("," item)? ")"\nitem: "ab" | "c"'


class Case(NamedTuple):
    name: str
    params: dict[str, Any]  # StructuredOutputsParams keywords
    valid: Callable[[str], bool]


def _schema_valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _lark_valid(grammar: str) -> Callable[[str], bool]:
    def valid(text: str) -> bool:
        import lark

        try:
            lark.Lark(grammar, parser="lalr").parse(text)
        except lark.exceptions.LarkError:
            return False
        return True

    return valid


def _date_valid(text: str) -> bool:
    import datetime

    try:
        datetime.date.fromisoformat(json.loads(text))
    except (ValueError, TypeError):
        return False
    return bool(re.fullmatch(r'"[0-9]{4}-[0-9]{2}-[0-9]{2}"', text))


CASES = [
    Case("json", {"json": SCHEMA}, _schema_valid),
    Case("regex", {"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
    Case("choice", {"choice": CHOICES}, lambda text: text in CHOICES),
    Case("grammar_ebnf", {"grammar": EBNF}, _lark_valid(EBNF_TWIN)),
    Case("grammar_lark", {"grammar": LARK}, _lark_valid(LARK)),
]
GUIDANCE_CASE = Case("json_guidance", {"json": {"type": "string", "format": "date"}}, _date_valid)


@lru_cache(maxsize=4)
def _hf(model_dir: str) -> tuple[Any, Any, Any]:
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # vLLM's XgrammarBackend: TokenizerInfo.from_huggingface with the model's vocabulary size.
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    return model, info, xgr.GrammarCompiler(info)


def _compile(compiler: Any, params: dict[str, Any], any_whitespace: bool) -> Any:
    """The grammar vLLM 0.11's xgrammar backend compiles for ``params`` (``backend_xgrammar.py``;
    ``any_whitespace`` is ``not structured_outputs_config.disable_any_whitespace``)."""
    from vllm.v1.structured_output.utils import choice_as_grammar, convert_lark_to_ebnf, grammar_is_likely_lark

    if "json" in params:
        return compiler.compile_json_schema(json.dumps(params["json"]), any_whitespace=any_whitespace)
    if "regex" in params:
        return compiler.compile_regex(params["regex"])
    if "choice" in params:
        return compiler.compile_grammar(choice_as_grammar(params["choice"]))
    grammar = params["grammar"]
    return compiler.compile_grammar(convert_lark_to_ebnf(grammar) if grammar_is_likely_lark(grammar) else grammar)


def hf_structured_greedy(
    model_dir: str | os.PathLike[str],
    prompt: list[int],
    params: dict[str, Any],
    max_tokens: int = MAX_TOKENS,
    any_whitespace: bool = False,
) -> list[int]:
    """Greedy tokens of ``prompt`` under the grammar of ``params`` (HF float32 logits, xgrammar's matcher and CPU
    mask), ending with the stop token the grammar allowed and the model chose, or after ``max_tokens``.
    ``any_whitespace``: as the engine's ``structured_outputs_config`` (see :data:`ENGINE_KWARGS`)."""
    import torch
    import xgrammar as xgr

    model, info, compiler = _hf(str(model_dir))
    matcher = xgr.GrammarMatcher(_compile(compiler, params, any_whitespace))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    out: list[int] = []
    ids = torch.tensor([prompt])
    past = None
    with torch.no_grad():
        for _ in range(max_tokens):
            step = model(ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            logits = step.logits[:, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax(-1))
            out.append(token)
            if token in info.stop_token_ids:
                break
            assert matcher.accept_token(token), (params, out)
            ids = torch.tensor([[token]])
    return out


def structured_params(case: Case, max_tokens: int = MAX_TOKENS) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputsParams(**case.params)
    )


def without_stop(model_dir: str | os.PathLike[str], tokens: list[int]) -> list[int]:
    """``tokens`` without a final stop token of ``model_dir``'s tokenizer (vLLM reports it in some outputs only)."""
    stop = set(_hf(str(model_dir))[1].stop_token_ids)
    return tokens[:-1] if tokens and tokens[-1] in stop else list(tokens)


def structured_prompts(seed: int = 31) -> list[list[int]]:
    """Token prompts for :func:`check_structured` (seed 31: every case ends well within :data:`MAX_TOKENS` on the
    suite's tiny Qwen2 and Llama models, std 0.02 and 0.1)."""
    from .engine import make_prompts

    return make_prompts(PROMPT_LENGTHS, seed=seed)


def check_structured(
    llm: Any, model_dir: str | os.PathLike[str] | None, prompts: list[list[int]], cases: list[Case] = CASES
) -> list[Any]:
    """Every case of ``cases`` on its prompt of ``prompts`` and a plain greedy request (the last prompt), in one
    batch of ``llm``.

    Each structured output must finish with ``stop`` (the grammar ended it, not ``max_tokens``) and pass its
    checker; with ``model_dir`` (a float32 engine) its tokens must equal :func:`hf_structured_greedy`'s, and the
    plain request's HF's greedy tokens. Returns the outputs (structured ones first), for callers that compare runs.
    """
    from vllm import SamplingParams

    from .engine import token_prompts
    from .models import hf_greedy

    assert len(prompts) == len(cases) + 1
    config = llm.llm_engine.vllm_config.structured_outputs_config
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    params = [structured_params(case) for case in cases] + [plain]
    outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    for case, prompt, out in zip(cases, prompts, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (case.name, completion)
        assert case.valid(completion.text), (case.name, completion.text)
        if model_dir is not None:
            whitespace = not config.disable_any_whitespace
            want = hf_structured_greedy(model_dir, prompt, case.params, any_whitespace=whitespace)
            got = without_stop(model_dir, list(completion.token_ids))
            assert got == without_stop(model_dir, want), (case.name, completion)
    if model_dir is not None:
        assert list(outputs[-1].outputs[0].token_ids) == hf_greedy(model_dir, [prompts[-1]], 8)[0]
    return outputs


def _model_runner(worker: Any) -> Any:
    return worker.model_runner


def check_structured_masked_per_step(
    llm: Any,
    model_dir: str | os.PathLike[str] | None,
    mode: str | None = None,
    mask: Callable[..., None] | None = None,
    cases: list[Case] = CASES,
) -> tuple[list[Any], list[int]]:
    """:func:`check_structured` (``cases`` on :func:`structured_prompts`) on an in-process engine whose runner masks
    through ``mask`` (default: the mask it selected), which records this process's ``mode`` graph replays
    (``"FULL"`` / ``"PIECEWISE"``; None: no graphs) at each call. Returns the outputs and the recorded counts, one
    per masked step."""
    from vllm_npu.platform.graphs.wrapper import GRAPH_STATS

    (runner,) = llm.collective_rpc(_model_runner)
    selected = runner.grammar_mask
    apply = mask or selected
    seen: list[int] = []

    def recording(logits: Any, rows: list[int], bitmask: Any) -> None:
        seen.append(GRAPH_STATS.replays[mode] if mode else 0)
        apply(logits, rows, bitmask)

    runner.grammar_mask = recording
    try:
        outputs = check_structured(llm, model_dir, structured_prompts(), cases)
    finally:
        runner.grammar_mask = selected
    return outputs, seen
