# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen3-Next's multi-token-prediction draft (``Qwen3NextMTP``, vLLM's speculative method ``qwen3_next_mtp``/``mtp``)
on the NPU.

vLLM 0.11's ``qwen3_next_mtp`` module imports ``qwen3_next`` for its decoder layer and norm, and that import fails on a
host without a working Triton (its FLA modules read ``tl.exp`` at import), so the draft could not even be built. This
is the same draft on :mod:`.qwen3_next`'s layers: the token's embedding and the target's last hidden state, each
RMS-normed (``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``), concatenated ``[embedding | hidden]`` and projected
back by ``fc``, then ``num_nextn_predict_layers`` gated full-attention decoder layers (MoE as the target's; step ``i``
of a multi-step draft uses layer ``i mod n``) and the final norm. Checkpoint names are the target checkpoint's
``mtp.*`` tensors (``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.layers.N.*``, ``mtp.norm``); the embedding and LM head are
the target's (vLLM's EAGLE proposer shares them after loading). The draft has no GDN layer: only the target's GDN
layers verify the ``1 + k`` tokens (:mod:`.qwen3_next_gdn`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm_npu.interface import ConfigError

from .qwen3_next import NPUQwen3NextDecoderLayer, load_body_weights


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "inputs_embeds": 0})
class NPUQwen3NextMultiTokenPredictor(nn.Module):
    """The draft's body (``mtp.*`` in the checkpoint): fc over ``[norm(embedding) | norm(hidden)]``, MTP layers,
    final norm. ``forward`` returns the hidden states ``[T, hidden]`` the LM head reads (and the next draft step
    feeds back as ``hidden_states``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.num_mtp_layers = int(getattr(config, "num_nextn_predict_layers", 1) or 1)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.fc = ColumnParallelLinear(
            config.hidden_size * 2,
            config.hidden_size,
            gather_output=True,
            bias=False,
            return_bias=False,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.fc",
        )
        self.layers = nn.ModuleList(
            NPUQwen3NextDecoderLayer(vllm_config, "full_attention", prefix=f"{prefix}.layers.{i}")
            for i in range(self.num_mtp_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_fc_norm_embedding = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(input_ids)
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        embeds = inputs_embeds if inputs_embeds is not None else self.get_input_embeddings(input_ids)
        merged = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden_states)], dim=-1)
        hidden: torch.Tensor = self.fc(merged)
        hidden, residual = self.layers[spec_step_idx % self.num_mtp_layers](hidden, None, positions)
        out, _ = self.norm(hidden, residual)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names relative to this module (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...): the target
        body's loader (stacked q/k/v and gate/up, experts through ``FusedMoE``'s mapping) does exactly this."""
        return load_body_weights(self, self.config.num_experts, weights)


class NPUQwen3NextMTP(nn.Module):
    """``Qwen3NextMTP`` served by vllm-npu (see the module docstring)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        if vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError(
                "Qwen3-Next's MTP draft does not support prefix caching (vLLM 0.11 caches no recurrent state); "
                "drop --enable-prefix-caching"
            )
        self.config = config
        self.model = NPUQwen3NextMultiTokenPredictor(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "mtp"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:  # no lm_head tensor in the checkpoint
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids, positions, hidden_states, inputs_embeds)
        return out

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        logits: torch.Tensor | None = self.logits_processor(self.lm_head, hidden_states)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The target checkpoint: ``mtp.*`` goes to the draft body (as ``model.*``), the embedding and LM head are
        loaded too (vLLM's proposer then replaces them by the target's when shapes match), the rest is skipped."""

        def draft_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, weight in weights:
                if name.startswith("mtp."):
                    yield "model." + name[len("mtp.") :], weight
                elif name.startswith("model.embed_tokens.") or name.startswith("lm_head."):
                    yield name, weight

        skip = ["lm_head."] if self.config.tie_word_embeddings else []
        return AutoWeightsLoader(self, skip_prefixes=skip).load_weights(draft_weights())
