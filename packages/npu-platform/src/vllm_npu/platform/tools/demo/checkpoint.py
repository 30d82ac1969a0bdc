# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The demo's embedded model: a byte-level BPE tokenizer and a tiny Qwen2 trained on bundled public-domain text.

Everything is built locally (no hub download) the first time and cached; later runs load the cache. Training is a
few hundred AdamW steps on the CPU (seconds), enough for the model to learn the passages in ``corpus.txt`` so that
its greedy continuations read as language.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Architecture of the demo model (a Qwen2 with grouped-query attention).
DEMO_ARCH: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
TRAIN_STEPS = 300
VOCAB_SIZE = 512


def corpus() -> str:
    """The bundled public-domain passages (Lincoln, Dickens, Melville, Austen, the US Constitution, Genesis)."""
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def build_tokenizer(text: str, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``text``, with a ChatML-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def cache_dir() -> Path:
    """``VLLM_NPU_CACHE_DIR`` (read through the validated environment schema), else ``$XDG_CACHE_HOME/vllm-npu``."""
    from vllm_npu.interface import EnvConfig

    base = EnvConfig.from_environ().CACHE_DIR or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm-npu"
    )
    return Path(base)


def _key(text: str) -> str:
    blob = json.dumps({"arch": DEMO_ARCH, "steps": TRAIN_STEPS, "vocab": VOCAB_SIZE, "text": text}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def demo_model_dir() -> Path:
    return cache_dir() / f"demo-qwen2-{_key(corpus())}"


def train_demo_model(out: Path, *, steps: int = TRAIN_STEPS, seed: int = 0) -> dict[str, float]:
    """Train the demo model on the corpus and save it (safetensors + tokenizer) to ``out``. Returns loss stats."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text = corpus()
    tokenizer = build_tokenizer(text)
    ids = torch.tensor(tokenizer(text.replace("\n", " "))["input_ids"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **DEMO_ARCH,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    window, batch = 96, 16
    first = last = float("nan")
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - window - 1, (batch,))
        x = torch.stack([ids[s : s + window] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stats = {"first_loss": first, "final_loss": last, "tokens": float(len(ids)), "steps": float(steps)}
    (out / "demo_training.json").write_text(json.dumps(stats, indent=2))
    (out / ".complete").write_text(_key(text))
    return stats


def _train_in_child(out: str) -> None:
    import torch

    # The model is tiny: one intra-op thread is as fast as two on an idle host and avoids OpenMP barrier spinning
    # (tens of times slower) when the host is busy.
    torch.set_num_threads(1)
    train_demo_model(Path(out))


def _train(staging: Path) -> int | None:
    """Train into ``staging`` in a spawned child process; returns its exit code.

    Training runs in a child: CPU torch work in this process before vLLM forks its engine core can leave OpenMP in a
    state that deadlocks the child.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_train_in_child, args=(str(staging),))
    proc.start()
    try:
        proc.join()
    except BaseException:  # Ctrl-C: the child got it too (same process group); don't leave it writing
        proc.terminate()
        proc.join()
        raise
    return proc.exitcode


def ensure_demo_model() -> tuple[Path, bool]:
    """The cached demo checkpoint, trained now if missing. Returns (path, built_now).

    The checkpoint is built in a private sibling of its cache directory and renamed into place once complete
    (:func:`vllm_npu.interface.staging.staged_directory`): an interrupted or failed build leaves nothing at the
    cache path, and two demos building at once never read each other's half-written files (the second to finish
    keeps the first one's). A directory at the cache path without the ``.complete`` marker (left by an
    older plugin that trained in place) is rebuilt.
    """
    import shutil

    from vllm_npu.interface import staged_directory

    out = demo_model_dir()
    if (out / ".complete").exists():
        return out, False
    if out.exists():
        shutil.rmtree(out)  # an incomplete build of this very key (the name is ours), never a user's directory
    try:
        with staged_directory(out) as staging:
            exitcode = _train(staging)
            if exitcode != 0 or not (staging / ".complete").exists():
                raise RuntimeError(f"building the demo model in {out} failed (exit code {exitcode})")
    except FileExistsError:
        if not (out / ".complete").exists():
            raise
        # another demo finished first: its checkpoint is the same (same key), keep it
    return out, True
