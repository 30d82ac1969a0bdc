# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The shared scenario of the speculative-decoding engine modules (EAGLE, EAGLE-3, DeepSeek MTP).

Each module starts one engine with its ``speculative_config`` (:func:`spec_engine`) and runs these checks on it:

- :func:`greedy_counted`: greedy tokens plus what vLLM's spec-decode stats counted meanwhile (drafted and accepted
  draft tokens, from the engine's Prometheus counters, as on CUDA);
- :func:`seeded_sampling_twice`: a batch mixing a greedy request with seeded random ones, generated twice.

The engine core runs in its own process: vLLM 0.11 hands the drafted tokens to the scheduler in
``EngineCore.post_step``, which only the engine-core busy loop calls (in process, nothing would be drafted).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .engine import emulated_env, engine, greedy, make_prompts, token_prompts

#: Prompt lengths of the lossless checks: short and long requests in one batch; with ``max_num_batched_tokens=64``
#: the long ones prefill in chunks while the short ones already verify drafts.
MIXED_LENGTHS = (5, 30, 12, 60, 3, 140)
MAX_TOKENS = 64
MAX_BATCHED_TOKENS = 64


@contextlib.contextmanager
def spec_engine(
    model_dir: str | os.PathLike[str], tmp_path: Any, speculative_config: dict[str, Any], **kwargs: Any
) -> Iterator[Any]:
    """An engine (separate engine-core process) with ``speculative_config``, chunked prefill at
    :data:`MAX_BATCHED_TOKENS` tokens per step and vLLM's stats on."""
    env = emulated_env(tmp_path, multiprocessing=True)
    args = {"max_num_batched_tokens": MAX_BATCHED_TOKENS, "disable_log_stats": False, **kwargs}
    with engine(model_dir, env, speculative_config=speculative_config, **args) as llm:
        yield llm


def counter(llm: Any, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


@dataclass
class Counted:
    tokens: list[list[int]]
    drafted: int
    accepted: int


def greedy_counted(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = MAX_TOKENS) -> Counted:
    """Greedy tokens for ``prompts`` and the draft tokens vLLM counted as drafted / accepted during the call."""
    d0 = counter(llm, "vllm:spec_decode_num_draft_tokens")
    a0 = counter(llm, "vllm:spec_decode_num_accepted_tokens")
    tokens = greedy(llm, prompts, max_tokens)
    return Counted(
        tokens,
        int(counter(llm, "vllm:spec_decode_num_draft_tokens") - d0),
        int(counter(llm, "vllm:spec_decode_num_accepted_tokens") - a0),
    )


def mixed_prompts(seed: int = 1) -> list[list[int]]:
    return make_prompts(list(MIXED_LENGTHS), seed=seed)


def seeded_sampling_twice(llm: Any, max_tokens: int = 40) -> tuple[list[list[int]], list[list[int]], int]:
    """A greedy request and two seeded random ones (random acceptance, recovered-token sampling), generated twice;
    returns both runs' tokens and the draft tokens drafted meanwhile."""
    from vllm import SamplingParams

    prompts = token_prompts(make_prompts([5, 30, 12], seed=2))
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.3, seed=11, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=12, max_tokens=max_tokens, ignore_eos=True),
    ]
    d0 = counter(llm, "vllm:spec_decode_num_draft_tokens")
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return first, second, int(counter(llm, "vllm:spec_decode_num_draft_tokens") - d0)
