# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Shared scenario of the static-graph engine modules (``tests/e2e/test_graph_*``): one engine per module, each check
compared token for token with HF transformers (float32, greedy).

- :func:`graph_engine` starts a module's engine with :func:`engine_kwargs`;
- :data:`CAPTURE_SIZES` are the captured batch sizes; :func:`check_every_batch_size` runs batches of every size
  from 1 to one past the largest, so padding to a capture size and the eager fallback above it are both hit
  (:func:`check_every_batch_size_replayed` also asserts the graphs were replayed);
- :func:`check_mixed_and_chunked`: prompts of 1..150 tokens with a 64-token step budget, so long prompts are
  prefilled in chunks while the short ones already decode (mixed prefill/decode steps);
- :func:`check_prefix_cache`: two prompts sharing ``prefix_blocks`` full KV blocks, the second served from the cache;
- :func:`check_skipped_refresh_gives_wrong_tokens`: FULL replays without the per-step metadata refresh go wrong;
- the torchair modules: :func:`torchair_stats` / :func:`stats_delta` (the process's torchair counts and what changed
  between two snapshots) and :func:`stale_graph_outputs` (decode steps run on the first step's graph inputs).

Prompt seeds are chosen so that no HF greedy continuation hits EOS: ``hf_greedy`` forbids EOS (``min_new_tokens``)
while vLLM's ``ignore_eos`` still emits it, which would be a reference mismatch, not a bug.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .engine import emulated_env, engine, greedy, greedy_outputs, make_prompts
from .models import hf_greedy

CAPTURE_SIZES = [1, 2, 4, 8]
MAX_BATCH = CAPTURE_SIZES[-1] + 1
NEW_TOKENS = 8
#: Prompt lengths of the mixed-batch check: very different lengths in one batch (1 to 150 tokens).
MIXED_LENGTHS = [1, 5, 8, 40, 150]


def engine_kwargs(mode: str, *, block_size: int) -> dict[str, Any]:
    """``LLM`` arguments of a graph module: vLLM's own compilation knobs, chunked prefill, prefix caching."""
    return {
        "compilation_config": {"cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES},
        "block_size": block_size,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        "enable_prefix_caching": True,
    }


@contextlib.contextmanager
def graph_engine(
    model_dir: str | Path, tmp_path_factory: Any, name: str, mode: str, *, block_size: int, **kwargs: Any
) -> Iterator[Any]:
    """The module's engine: ``model_dir`` on the emulated device (state under a fresh ``name`` temp dir of pytest's
    ``tmp_path_factory``) with :func:`engine_kwargs` for cudagraph ``mode`` and KV ``block_size``, and ``kwargs``."""
    args = {**engine_kwargs(mode, block_size=block_size), **kwargs}
    with engine(model_dir, emulated_env(tmp_path_factory.mktemp(name)), **args) as llm:
        yield llm


def runtime_info(llm: Any) -> dict[str, Any]:
    (info,) = llm.collective_rpc("npu_runtime_info")
    return info


def check_every_batch_size(llm: Any, model_dir: Any) -> None:
    pool = make_prompts([3 + (7 * i) % 13 for i in range(MAX_BATCH)], seed=21)
    ref = hf_greedy(model_dir, pool, NEW_TOKENS)
    for n in range(1, MAX_BATCH + 1):
        assert greedy(llm, pool[:n], NEW_TOKENS) == ref[:n], f"batch of {n}"


def check_every_batch_size_replayed(llm: Any, model_dir: Any, mode: str) -> None:
    """:func:`check_every_batch_size`, and the ``mode`` graphs (``"PIECEWISE"`` or ``"FULL"``) were replayed."""
    before = replays(llm, mode)
    check_every_batch_size(llm, model_dir)
    assert replays(llm, mode) > before


def check_mixed_and_chunked(llm: Any, model_dir: Any) -> None:
    prompts = make_prompts(MIXED_LENGTHS, seed=12)
    assert greedy(llm, prompts, NEW_TOKENS) == hf_greedy(model_dir, prompts, NEW_TOKENS)


def check_prefix_cache(llm: Any, model_dir: Any, *, block_size: int, prefix_blocks: int = 2, seed: int = 13) -> None:
    """``seed`` draws the shared prefix (pick one whose continuations avoid EOS, see the module docstring)."""
    prefix = make_prompts([block_size * prefix_blocks + 3], seed=seed)[0]
    first, second = prefix + [7, 8, 9], prefix + [21, 22]
    assert greedy(llm, [first], NEW_TOKENS) == hf_greedy(model_dir, [first], NEW_TOKENS)
    (out,) = greedy_outputs(llm, [second], NEW_TOKENS)
    assert out.num_cached_tokens >= block_size * prefix_blocks, out.num_cached_tokens
    assert [list(out.outputs[0].token_ids)] == hf_greedy(model_dir, [second], NEW_TOKENS)


def check_skipped_refresh_gives_wrong_tokens(llm: Any, model_dir: Any, monkeypatch: Any) -> None:
    """With the per-replay metadata refresh skipped, FULL replays keep the capture-time sequence lengths (all 1:
    each decode step attends to one cached token), so the tokens after the first (from the eager prefill) are
    wrong; with the refresh back they equal HF again. ``monkeypatch`` is pytest's fixture."""
    from vllm_npu.platform.graphs.wrapper import NPUGraphWrapper

    prompts = make_prompts([5, 8, 40], seed=14)
    ref = hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert greedy(llm, prompts, NEW_TOKENS) == ref
    monkeypatch.setattr(NPUGraphWrapper, "refresh", staticmethod(lambda graph: None))
    stale = greedy(llm, prompts, NEW_TOKENS)
    assert stale != ref
    assert all(s[0] == r[0] for s, r in zip(stale, ref, strict=True))  # the first token comes from the prefill
    monkeypatch.undo()
    assert greedy(llm, prompts, NEW_TOKENS) == ref


def replays(llm: Any, mode: str) -> int:
    return int(runtime_info(llm)["graphs"]["replays"].get(mode, 0))


def torchair_stats() -> dict[str, Any]:
    """A snapshot of this process's torchair counts (``TORCHAIR_STATS``: every engine of the process adds to them)."""
    from vllm_npu.platform.graphs.torchair import TORCHAIR_STATS

    return TORCHAIR_STATS.snapshot()


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What changed between two :func:`torchair_stats` snapshots (per-size counts: only the sizes that changed)."""
    out: dict[str, Any] = {}
    for name, value in after.items():
        if isinstance(value, dict):
            diff = Counter(value)
            diff.subtract(before[name])
            out[name] = {k: v for k, v in diff.items() if v}
        else:
            out[name] = value - before[name]
    return out


def stale_graph_outputs(llm: Any, prompts: list[list[int]], new_tokens: int, metadata_cls: type) -> list[list[int]]:
    """Greedy outputs of ``prompts`` (one compiled-size batch) whose compiled decode steps all get the first step's
    graph inputs: ``metadata_cls.graph_inputs`` (the backend's metadata class) hands out the first result again."""
    fresh = metadata_cls.graph_inputs
    first: list[Any] = []

    def stale(self: Any, batch_size: int) -> Any:
        first.append(first[0] if first else fresh(self, batch_size))
        return first[0]

    metadata_cls.graph_inputs = stale
    try:
        return greedy(llm, prompts, new_tokens)
    finally:
        metadata_cls.graph_inputs = fresh
