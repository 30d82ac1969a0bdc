# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real-vLLM engines on the emulated device, for every test module and benchmark.

The contract (keep it stable: every layer's e2e tests use it)::

    from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config

    @pytest.fixture(scope="module")
    def llm(tmp_path_factory):
        model = build_tiny_model(tiny_config("qwen2"))
        with engine(model, emulated_env(tmp_path_factory.mktemp("vllm"))) as llm:
            yield llm

- :func:`emulated_env` returns the environment an engine run needs: ``VLLM_NPU_DEVICE=emulated`` and private
  cache/config/IPC dirs, offline hub, no usage stats, in-process engine core by default.
- :func:`engine` applies that environment (restored on exit), builds an ``LLM`` with :func:`make_llm` and shuts it
  down cleanly, so the next module can start its own engine in the same pytest process.
- :func:`make_llm` builds ``vllm.LLM`` with test-friendly defaults (float32, small ``max_model_len``, seed 0).

Fork hazard: a forked engine-core or worker process deadlocks if this process already ran torch CPU work (an HF
reference ``generate``), because OpenMP state does not survive ``fork``. Hence the default in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); multi-process runs (TP>1, ``vllm serve``) use ``spawn``, which the emulated
platform selects itself unless ``VLLM_WORKER_MULTIPROC_METHOD`` is set.

Platform resolution: vLLM resolves ``current_platform`` once per process. :func:`engine` refuses to run (with the
fix in the message) when vLLM already resolved a different platform in this process, instead of silently running
on the wrong one.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .gc_heap import freeze_long_lived_heap
from .model_info import warm_model_info

#: Defaults of :func:`make_llm`; any keyword argument overrides them.
LLM_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "seed": 0,
    "max_model_len": 512,
    "max_num_seqs": 16,
    "disable_log_stats": True,
}


def emulated_env(
    tmp_path: str | os.PathLike[str],
    *,
    multiprocessing: bool = False,
    kv_cache_gb: float | None = 0.0625,
    extra: Mapping[str, str] | None = None,
    vllm_cache_root: str | os.PathLike[str] | None = None,
) -> dict[str, str]:
    """The environment of one engine run on the emulated device, with its writable dirs under ``tmp_path``.

    ``multiprocessing=False`` runs the engine core in this process (no fork, fast start); ``True`` uses vLLM's
    separate engine-core process (spawned). ``kv_cache_gb`` sets ``VLLM_NPU_EMULATED_KV_CACHE_GB`` (None = the
    platform default); the small default keeps test engines light. ``extra`` is merged last.

    ``VLLM_CACHE_ROOT`` defaults to one directory shared by all test runs (:func:`shared_vllm_cache_root`, never the
    user's ``~/.cache/vllm``): vLLM caches there what it learns by importing each model class in a subprocess
    (5-15 s per engine start otherwise). Pass ``vllm_cache_root=tmp_path`` for a fully private run.
    """
    root = Path(tmp_path)
    dirs = {name: root / name for name in ("vllm_config", "hf_home", "inductor", "npu_cache")}
    # ZMQ IPC socket paths must fit sockaddr_un (107 bytes): pytest's tmp paths are too deep for vLLM's
    # "<rpc dir>/<uuid4>" names, so the socket dir is a short one directly under the system temp dir.
    dirs["rpc"] = Path(tempfile.mkdtemp(prefix="vrpc-"))
    dirs["vllm_cache"] = Path(vllm_cache_root) if vllm_cache_root is not None else shared_vllm_cache_root()
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    env = {
        "VLLM_NPU_DEVICE": "emulated",
        "VLLM_CACHE_ROOT": str(dirs["vllm_cache"]),
        "VLLM_CONFIG_ROOT": str(dirs["vllm_config"]),
        "HF_HOME": str(dirs["hf_home"]),
        "TORCHINDUCTOR_CACHE_DIR": str(dirs["inductor"]),
        "VLLM_NPU_CACHE_DIR": str(dirs["npu_cache"]),  # the plugin's compile caches, never the user's
        "VLLM_RPC_BASE_PATH": str(dirs["rpc"]),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
    }
    if kv_cache_gb is not None:
        env["VLLM_NPU_EMULATED_KV_CACHE_GB"] = repr(float(kv_cache_gb))
    env.update(extra or {})
    return env


def shared_vllm_cache_root() -> Path:
    """The ``VLLM_CACHE_ROOT`` shared by test engines: ``vllm-cache`` under the testkit's model cache."""
    from .models import default_cache_dir

    return default_cache_dir() / "vllm-cache"


@contextlib.contextmanager
def patched_environ(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the duration of the block, then restore the previous values."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_platform_resolution() -> None:
    """Raise if vLLM already resolved a platform other than the emulated NPU platform in this process."""
    import sys

    platforms = sys.modules.get("vllm.platforms")
    resolved = getattr(platforms, "_current_platform", None) if platforms is not None else None
    if resolved is None:
        from vllm_npu.interface import reset_device_selection

        reset_device_selection()  # the env may have changed since a previous decision in this process
        return
    if type(resolved).__name__ != "EmulatedNPUPlatform":
        raise RuntimeError(
            f"vLLM already resolved its platform to {type(resolved).__name__} in this process, before "
            "VLLM_NPU_DEVICE=emulated was set; set VLLM_NPU_DEVICE=emulated in the environment before anything "
            "imports vLLM (e.g. run this test file on its own, or export it for the whole pytest session)"
        )


#: ``npu`` keys of ``additional_config`` that choose a graph or compile mode.
GRAPH_KEYS = ("graph_mode", "emulated_compile")


def chooses_graphs(kwargs: Mapping[str, Any]) -> bool:
    """Whether ``LLM`` keyword arguments choose the graph mode themselves (``enforce_eager``, a
    ``compilation_config``, or ``npu.graph_mode`` / ``npu.emulated_compile``)."""
    npu = (kwargs.get("additional_config") or {}).get("npu") or {}
    return "enforce_eager" in kwargs or "compilation_config" in kwargs or any(k in npu for k in GRAPH_KEYS)


def pin_eager(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``enforce_eager=True`` unless they choose the graph mode (:func:`chooses_graphs`): the
    emulated device's default compiles and captures (docs/graphs.md), which tests not about graphs do not need."""
    return dict(kwargs) if chooses_graphs(kwargs) else {**kwargs, "enforce_eager": True}


def make_llm(model_dir: str | os.PathLike[str], **kwargs: Any):
    """``vllm.LLM`` for ``model_dir`` with :data:`LLM_DEFAULTS` (overridden by ``kwargs``), eager unless ``kwargs``
    choose a graph mode (:func:`pin_eager`). The environment must already be set (see :func:`engine`)."""
    check_platform_resolution()
    import torch
    from vllm import LLM

    # An in-process engine (the emulated device's default) shares Dynamo's state with the engines earlier test
    # modules built in this pytest worker. Dynamo's automatic dynamic then marks what differed between those models
    # as dynamic (e.g. a LayerNorm's eps: XLM-R 1e-5, then BERT 1e-12), and the emulated twin's trace of the piece
    # fails on the resulting .item(). A served model has its process to itself: start from the same clean state.
    torch._dynamo.reset()
    warm_model_info(model_dir)  # vLLM's model-class inspection from this process, not a subprocess (model_info.py)
    args = pin_eager({**LLM_DEFAULTS, **kwargs})
    return LLM(model=str(model_dir), **args)


def shutdown_llm(llm: Any) -> None:
    """Stop ``llm``'s engine core (and workers) and tear down the in-process distributed state, so another engine
    can start in this process."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    _cleanup_distributed()


def _cleanup_distributed() -> None:
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    gc.collect()


@contextlib.contextmanager
def engine(model_dir: str | os.PathLike[str], env: Mapping[str, str], **kwargs: Any) -> Iterator[Any]:
    """An ``LLM`` on the emulated device for the duration of the block (environment applied, then restored)."""
    with patched_environ(env):
        freeze_long_lived_heap()  # the imports' heap out of the start-up and teardown collections (gc_heap.py)
        try:
            llm = make_llm(model_dir, **kwargs)
        except BaseException:
            # A failed start can leave this process's distributed state initialised; clear it for the next engine.
            _cleanup_distributed()
            raise
        try:
            yield llm
        finally:
            shutdown_llm(llm)
            del llm
            gc.collect()
            rpc = Path(env.get("VLLM_RPC_BASE_PATH", ""))
            if rpc.name.startswith("vrpc-") and rpc.parent == Path(tempfile.gettempdir()):
                shutil.rmtree(rpc, ignore_errors=True)  # the short socket dir emulated_env made


@contextlib.contextmanager
def ep2_engine(model_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str], **kwargs: Any) -> Iterator[Any]:
    """An ``LLM`` with TP=2 and expert parallel over two spawned mp workers (the MoE expert-parallel modules' engine:
    64-token steps, so prompts past that are chunked); ``kwargs`` go to ``LLM`` on top."""
    env = emulated_env(cache_dir, extra={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    with engine(
        model_dir,
        env,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        distributed_executor_backend="mp",
        max_num_batched_tokens=64,
        **kwargs,
    ) as llm:
        yield llm


# --- inputs and outputs -----------------------------------------------------------------------------------------


def make_prompts(
    lengths: Sequence[int], *, vocab_size: int = 512, seed: int = 0, avoid: Sequence[int] = ()
) -> list[list[int]]:
    """Deterministic token-id prompts of the given lengths (ids in ``[3, vocab_size)``, special ids skipped)."""
    import random

    rng = random.Random(seed)
    banned = set(avoid)
    out = []
    for n in lengths:
        ids: list[int] = []
        while len(ids) < n:
            t = rng.randrange(3, vocab_size)
            if t not in banned:
                ids.append(t)
        out.append(ids)
    return out


def token_prompts(prompts: Sequence[Sequence[int]]) -> list[Any]:
    """vLLM ``TokensPrompt`` dicts for token-id prompts."""
    return [{"prompt_token_ids": list(p)} for p in prompts]


def greedy_outputs(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int, **sampling: Any) -> list[Any]:
    """vLLM's ``RequestOutput`` of greedy generation for each prompt (``ignore_eos``: always ``max_tokens`` tokens),
    for tests that need more than the tokens (e.g. ``num_cached_tokens``)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return llm.generate(token_prompts(prompts), params, use_tqdm=False)


def greedy(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int, **sampling: Any) -> list[list[int]]:
    """Greedy token ids for each prompt (``ignore_eos``: always ``max_tokens`` tokens)."""
    return [list(o.outputs[0].token_ids) for o in greedy_outputs(llm, prompts, max_tokens, **sampling)]


# --- tiny configs -----------------------------------------------------------------------------------------------


def tiny_config(arch: str = "qwen2", **overrides: Any) -> Any:
    """A tiny ``transformers`` config: ``arch`` "qwen2" or "llama" (GQA: hidden 64, 2 layers, 4 query heads, 2 KV
    heads, head dim 16, vocab 512), "qwen3_moe" (:data:`QWEN3_MOE_TINY`) or "deepseek_v3" (:data:`DEEPSEEK_V3_TINY`).
    ``overrides`` replace any field."""
    import transformers

    common: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "rope_theta": 10000.0, **overrides})
    elif arch == "llama":
        cfg = transformers.LlamaConfig(**{**common, "rope_theta": 10000.0, "head_dim": 16, **overrides})
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**QWEN3_MOE_TINY, **overrides})
    elif arch == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**{**DEEPSEEK_V3_TINY, **overrides})
    else:
        raise ValueError(f"tiny_config: unknown arch {arch!r}; expected 'qwen2', 'llama', 'qwen3_moe' or 'deepseek_v3'")
    return cfg


#: The tiny Qwen3-MoE of :func:`tiny_config` ("qwen3_moe"): every decoder layer MoE, 6 experts (not a power of two)
#: top-2 with renormalised weights, GQA 4/2 heads of dim 16.
QWEN3_MOE_TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


#: The tiny DeepSeek-V3 of :func:`tiny_config` ("deepseek_v3"): MLA with q-LoRA, layer 0 a dense MLP and layer 1 an
#: MoE layer (vLLM's DeepSeek needs one), 4 routed experts top-2 plus a shared expert, one expert group.
DEEPSEEK_V3_TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    # What DeepSeek-V3's config.json says. vLLM 0.11.0 read DeepSeek-V3 configs through its own config class, whose
    # default this is; 0.11.1 uses transformers' class, which has no such default, so without it the gate has no
    # e_score_correction_bias and loading the checkpoint's fails (KeyError).
    "topk_method": "noaux_tc",
    # Likewise (DeepSeek-V3's config.json): without it vLLM 0.11.1 routes with its default softmax while HF's
    # DeepSeek-V3 router always takes the sigmoid, and greedy tokens part after a few steps.
    "scoring_func": "sigmoid",
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
}
