# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The Hugging Face config of Pangu Pro MoE (``model_type`` ``"PanguProMoE"``).

transformers has no class for this model type (the published checkpoint ships one as remote code), so a local
checkpoint's ``config.json`` loads without ``--trust-remote-code`` only once this class is registered with
``AutoConfig``; the models layer's load hook does that (``vllm_npu.models._hooks:register_configs``). The field
names and defaults are those of the published Pangu Pro MoE 72B checkpoint.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

MODEL_TYPE = "PanguProMoE"


class PanguProMoEConfig(PretrainedConfig):
    """Pangu Pro MoE: a decoder of GQA attention (q/k/v/o projections with bias, full-width RoPE) and MoGE blocks.

    MoGE (Mixture of Grouped Experts): the ``num_experts`` routed experts form ``num_experts_per_tok`` equal groups
    of consecutive ids and every token activates the best expert of each group (softmax over all experts, times a
    learned per-expert ``router_scale``), plus one always-active shared expert of width
    ``shared_expert_intermediate_size``. The head dim is ``hidden_size // num_attention_heads``.
    """

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 153376,
        hidden_size: int = 5120,
        num_hidden_layers: int = 48,
        num_attention_heads: int = 40,
        num_key_value_heads: int = 8,
        hidden_act: str = "silu",
        max_position_embeddings: int = 131072,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float = 16000000.0,
        rope_scaling: dict[str, Any] | None = None,
        moe_intermediate_size: int = 1344,
        shared_expert_intermediate_size: int = 5376,
        num_experts_per_tok: int = 8,
        num_experts: int = 64,
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.001,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_experts_per_tok = num_experts_per_tok
        self.num_experts = num_experts
        self.output_router_logits = output_router_logits
        self.router_aux_loss_coef = router_aux_loss_coef
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
