# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Tiny retrieval models built on the fly (no hub downloads) and their Hugging Face references, for the pooling
tests (``tests/e2e/test_pooling_*.py``, ``test_serve_pooling.py``) and ``benchmarks/embedding_throughput.py``.

Four kinds, shaped like the checkpoints users serve:

- ``"qwen3_embed"``: a Qwen3-Embedding-shaped ``Qwen3ForCausalLM`` whose tokenizer appends ``<|endoftext|>`` to
  every input (as Qwen3-Embedding's does), served with last-token pooling + normalize; its config lists
  ``matryoshka_dimensions``;
- ``"qwen3_rerank"``: a Qwen3-Reranker-shaped ``Qwen3ForCausalLM`` whose vocabulary holds the two judgement tokens
  ``no`` and ``yes``; vLLM converts it to ``Qwen3ForSequenceClassification`` (:data:`QWEN3_RERANKER_OVERRIDES`);
- ``"xlmr_embed"``: a bge-m3-shaped ``XLMRobertaModel`` (CLS pooling + normalize; ``<pad>`` = 1, so RoBERTa's
  position ids start at 2 and ``max_position_embeddings`` = max length + 2);
- ``"xlmr_rerank"``: a bge-reranker-v2-m3-shaped ``XLMRobertaForSequenceClassification`` (one label, sigmoid).

The references (:func:`hf_embeddings`, :func:`hf_scores`) run the same checkpoint through transformers, one input
at a time (no padding effects), with the pooling each model card prescribes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cache import cached_build
from .models import default_cache_dir

KINDS = ("qwen3_embed", "qwen3_rerank", "xlmr_embed", "xlmr_rerank")

#: The largest number of tokens an input of the tiny models may have (XLM-R's position table is 2 larger).
MAX_LEN = 512

#: vLLM 0.11's switch from Qwen3-Reranker's causal LM to a sequence classifier (``Qwen3ForSequenceClassification``,
#: ``vllm/model_executor/models/config.py``): the ``yes`` - ``no`` rows of the LM head become the score weight.
QWEN3_RERANKER_OVERRIDES: dict[str, Any] = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}

#: Matryoshka dimensions of the tiny Qwen3 embedder (hidden size 64), as ``matryoshka_dimensions`` in its config.
QWEN3_MATRYOSHKA = [16, 32, 64]

#: Qwen3-Embedding's instruction format for queries (documents go in bare).
QWEN3_INSTRUCTION = "Instruct: {task}\nQuery:{query}"

_QWEN3: dict[str, Any] = {
    "vocab_size": 520,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,  # Qwen3-Embedding / -Reranker 0.6B tie their embeddings
}

_XLMR: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": MAX_LEN + 2,
    "type_vocab_size": 1,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
}


def tokenizer(kind: str) -> Any:
    """The tokenizer of ``kind``: a byte-level BPE trained on the platform's bundled corpus.

    Qwen3 kinds: the demo tokenizer's specials (``<|endoftext|>`` = 0 is bos/eos/pad) plus the added tokens ``no``
    and ``yes``; ``qwen3_embed`` appends ``<|endoftext|>`` to every input. XLM-R kinds: ``<s>`` 0, ``<pad>`` 1,
    ``</s>`` 2, ``<unk>`` 3 and RoBERTa's ``<s> A </s></s> B </s>`` pairs, no ``token_type_ids``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    from vllm_npu.platform.tools.demo.checkpoint import CHAT_TEMPLATE, SPECIAL_TOKENS, corpus

    xlmr = kind.startswith("xlmr")
    specials = ["<s>", "<pad>", "</s>", "<unk>"] if xlmr else list(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus()], trainer=trainer)
    if xlmr:
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            cls_token="<s>",
            eos_token="</s>",
            sep_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            model_input_names=["input_ids", "attention_mask"],
        )
        return fast
    tok.add_tokens(["no", "yes"])
    if kind == "qwen3_embed":
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A $B <|endoftext|>", special_tokens=[("<|endoftext|>", 0)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def config(kind: str) -> Any:
    """The tiny ``transformers`` config of ``kind`` (special-token ids from :func:`tokenizer`)."""
    import transformers

    if kind in ("qwen3_embed", "qwen3_rerank"):
        cfg = transformers.Qwen3Config(**_QWEN3, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        if kind == "qwen3_embed":
            cfg.matryoshka_dimensions = list(QWEN3_MATRYOSHKA)
        return cfg
    if kind in ("xlmr_embed", "xlmr_rerank"):
        return transformers.XLMRobertaConfig(**_XLMR, bos_token_id=0, pad_token_id=1, eos_token_id=2, num_labels=1)
    raise ValueError(f"unknown pooling model kind {kind!r}; expected one of {', '.join(KINDS)}")


#: The transformers auto class that builds each kind (Qwen3ForCausalLM, XLMRobertaModel,
#: XLMRobertaForSequenceClassification).
_AUTO_CLASS = {
    "qwen3_embed": "AutoModelForCausalLM",
    "qwen3_rerank": "AutoModelForCausalLM",
    "xlmr_embed": "AutoModel",
    "xlmr_rerank": "AutoModelForSequenceClassification",
}


def build(kind: str, *, seed: int = 0, std: float = 0.2) -> Path:
    """Build (once; cached by content) the tiny checkpoint of ``kind`` and return its directory.

    Weight matrices are drawn N(0, ``std``), norm gains (``LayerNorm`` included: the testkit's generic initialiser
    misses BERT-style names, and near-zero gains collapse every embedding onto the bias) U(0.5, 1.5), the rest
    N(0, ``std``/4), so that different inputs give clearly different embeddings and scores."""
    cfg = config(kind)
    cfg.torch_dtype = "float32"
    blob = json.dumps(
        {"kind": kind, "config": cfg.to_dict(), "seed": seed, "std": std, "tokenizer": "pooling-bpe-v1"},
        sort_keys=True,
        default=str,
    )
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return cached_build(default_cache_dir() / f"{kind}-{key}", key, lambda d: _write(kind, cfg, d, seed, std))


def _write(kind: str, cfg: Any, out: Path, seed: int, std: float) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, _AUTO_CLASS[kind]).from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
            elif "norm" in name.lower() and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, std / 4)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer(kind).save_pretrained(out)


def llm_kwargs(kind: str) -> dict[str, Any]:
    """``vllm.LLM`` / ``vllm serve`` arguments that serve ``kind`` as its model card says (pooling runner)."""
    # enforce_eager=False (vLLM's default, said explicitly): the pooling modules test the default graph mode of a
    # pooling model (PIECEWISE on the emulated device), which the testkit's eager pin would otherwise replace.
    args: dict[str, Any] = {"runner": "pooling", "max_model_len": MAX_LEN, "enforce_eager": False}
    if kind == "qwen3_rerank":
        args["hf_overrides"] = dict(QWEN3_RERANKER_OVERRIDES)
    return args


# --- the Hugging Face references ---------------------------------------------------------------------------------


def hf_embeddings(model_dir: str | Path, kind: str, prompts: Sequence[Sequence[int]], dimensions: int | None = None):
    """The reference embedding of each token-id prompt: ``qwen3_embed`` the last token's final hidden state
    (Qwen3-Embedding's ``last_token_pool``), ``xlmr_embed`` the first (CLS) token's (bge-m3 dense), truncated to
    ``dimensions`` (Matryoshka) and L2-normalised. A list of float32 ``[dimensions or hidden]`` tensors."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(input_ids=torch.tensor([list(ids)])).last_hidden_state[0]
            vec = hidden[-1] if kind == "qwen3_embed" else hidden[0]
            if dimensions is not None:
                vec = vec[:dimensions]
            out.append(torch.nn.functional.normalize(vec, dim=-1))
    return out


def hf_scores(model_dir: str | Path, kind: str, prompts: Sequence[Sequence[int]]) -> list[float]:
    """The reference relevance score of each token-id prompt (query and document already joined): ``xlmr_rerank``
    sigmoid of the cross-encoder's logit (bge-reranker-v2-m3); ``qwen3_rerank`` P(yes) = softmax over the ``no`` /
    ``yes`` logits of the last token (Qwen3-Reranker's model card)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    scores = []
    with torch.no_grad():
        if kind == "xlmr_rerank":
            model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
            for ids in prompts:
                scores.append(float(torch.sigmoid(model(input_ids=torch.tensor([list(ids)])).logits[0, 0])))
            return scores
        tok = tokenizer(kind)
        no_id, yes_id = tok.convert_tokens_to_ids(["no", "yes"])
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        for ids in prompts:
            logits = lm(input_ids=torch.tensor([list(ids)])).logits[0, -1]
            scores.append(float(torch.softmax(logits[[no_id, yes_id]], dim=-1)[1]))
    return scores


def pair_ids(model_dir: str | Path, query: str, document: str) -> list[int]:
    """The token ids vLLM 0.11's scoring builds for (``query``, ``document``) (``entrypoints/score_utils.py``,
    ``get_score_prompt``): a cross-encoder's tokenizer pair encoding (RoBERTa's ``<s> q </s></s> d </s>``), or for
    an LLM converted to a reranker (``use_pad_token`` False, the Qwen3 reranker) the text ``query + document``."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if AutoConfig.from_pretrained(model_dir).model_type == "qwen3":
        return list(tok(query + document)["input_ids"])
    return list(tok(query, document)["input_ids"])


#: Qwen3-Reranker's prompt (its model card): the query part and the document part vLLM's scoring joins.
QWEN3_RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def qwen3_rerank_pair(instruction: str, query: str, document: str) -> tuple[str, str]:
    """(query part, document part) in Qwen3-Reranker's format, as its vLLM example passes them to ``LLM.score``."""
    return (
        f"{QWEN3_RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n",
        f"<Document>: {document}{QWEN3_RERANK_SUFFIX}",
    )


def text_ids(model_dir: str | Path, text: str) -> list[int]:
    """The token ids of ``text`` as vLLM's pooling path tokenizes it (special tokens added)."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])


def cosines(got: Sequence[Any], expected: Sequence[Any]) -> list[float]:
    """Cosine similarity of each pair of 1-D tensors (``got[i]`` with ``expected[i]``)."""
    import torch

    assert len(got) == len(expected), (len(got), len(expected))
    return [float(torch.nn.functional.cosine_similarity(g.float(), e.float(), dim=0)) for g, e in zip(got, expected)]
