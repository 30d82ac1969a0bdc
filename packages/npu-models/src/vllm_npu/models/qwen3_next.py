# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen3-Next (``Qwen3NextForCausalLM``) on the NPU: gated delta-net layers (:mod:`.qwen3_next_gdn`), gated full
attention with partial rotary, and sparse MoE with a sigmoid-gated shared expert.

vLLM 0.11's ``vllm.model_executor.models.qwen3_next`` cannot even be imported on a host without a working Triton (its
FLA modules read ``tl.exp`` from vLLM's Triton placeholder at import), so the architecture inspection fails before any
plugin code runs. This module is the same model built from vLLM's layer classes that import no Triton kernel (linear
layers, ``Attention``, ``FusedMoE``, ``GemmaRMSNorm``, ``get_rope``, Qwen2-MoE's MLP), so our CustomOp overrides
(npu-ops) and attention backends (npu-attention) serve it, with the GDN mixer on our kernel pairs. Checkpoint names
are HF's and vLLM's (``q_proj``/``k_proj``/``v_proj`` stacked into ``qkv_proj``, experts through ``FusedMoE``'s
mapping; the ``mtp.`` weights are the MTP draft's, :mod:`.qwen3_next_mtp`). Prefix caching is refused for hybrids by
vLLM itself (``MambaModelConfig`` turns it off); pipeline parallelism, EPLB and LoRA are not offered by this class.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.attention import Attention
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP
from vllm.model_executor.models.utils import AutoWeightsLoader, extract_layer_index, maybe_prefix
from vllm_npu.interface import ConfigError

from .qwen3_next_gdn import NPUQwen3NextGatedDeltaNet, num_speculative_tokens


class NPUQwen3NextSparseMoeBlock(nn.Module):
    """Routed experts (``FusedMoE``, softmax top-k, renormalised when ``norm_topk_prob``) plus the shared expert
    scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.tp_size = get_tensor_model_parallel_world_size()
        self.experts = FusedMoE(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            reduce_results=False,
            renormalize=config.norm_topk_prob,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        self.gate = ReplicatedLinear(
            config.hidden_size, config.num_experts, bias=False, quant_config=None, prefix=f"{prefix}.gate"
        )
        self.shared_expert: nn.Module | None = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = Qwen2MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.shared_expert_intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                reduce_results=self.experts.must_reduce_shared_expert_outputs(),
                prefix=f"{prefix}.shared_expert",
            )
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = None
        if self.shared_expert is not None:
            shared = F.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        router_logits, _ = self.gate(hidden_states)
        out = self.experts(hidden_states=hidden_states, router_logits=router_logits)
        if shared is not None:
            out = out + shared
        if self.tp_size > 1:
            out = self.experts.maybe_all_reduce_tensor_model_parallel(out)
        return out


class NPUQwen3NextAttention(nn.Module):
    """Full attention with per-head q/k RMS norm (Gemma style, ``1 + w``), partial rotary, and an output gate: the
    q projection is ``[q | gate]`` per head and the attention output is multiplied by ``sigmoid(gate)``."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        tp = get_tensor_model_parallel_world_size()
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.gated = getattr(config, "attn_output_gate", True)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads * (1 + self.gated),
            config.num_key_value_heads,
            bias=getattr(config, "qkv_bias", False),
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            head_size=self.head_dim,
            rotary_dim=self.head_dim,
            max_position=config.max_position_embeddings,
            base=config.rope_theta,
            rope_scaling=config.rope_scaling,
            partial_rotary_factor=config.partial_rotary_factor,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, output: torch.Tensor, hidden_states: torch.Tensor) -> None:
        qkv, _ = self.qkv_proj(hidden_states)
        gate = None
        if self.gated:
            q_gate, k, v = qkv.split([self.q_size * 2, self.kv_size, self.kv_size], dim=-1)
            q, gate = torch.chunk(q_gate.view(-1, self.num_heads, 2 * self.head_dim), 2, dim=-1)
            gate = gate.reshape(-1, self.q_size)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).view(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).view(-1, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        if gate is not None:
            attn_output = attn_output * torch.sigmoid(gate)
        output[:], _ = self.o_proj(attn_output)


class NPUQwen3NextDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, layer_type: str, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.layer_type = layer_type
        layer_idx = extract_layer_index(prefix)
        if layer_type == "linear_attention":
            self.linear_attn = NPUQwen3NextGatedDeltaNet(
                config,
                model_config=vllm_config.model_config,
                cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.linear_attn",
            )
        elif layer_type == "full_attention":
            self.self_attn = NPUQwen3NextAttention(vllm_config, prefix=f"{prefix}.self_attn")
        else:
            raise ConfigError(f"Qwen3-Next layer {layer_idx}: unknown layer type {layer_type!r}")
        sparse = (
            layer_idx not in getattr(config, "mlp_only_layers", [])
            and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0
        )
        self.mlp: nn.Module
        if sparse:
            self.mlp = NPUQwen3NextSparseMoeBlock(vllm_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Qwen2MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        mixed = torch.empty_like(hidden_states)
        if self.layer_type == "linear_attention":
            self.linear_attn(hidden_states=hidden_states, output=mixed)
        else:
            self.self_attn(positions=positions, output=mixed, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(hidden_states), residual


# explicit: with postponed annotations vLLM cannot read the tensor arguments off the signature
@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class NPUQwen3NextModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            NPUQwen3NextDecoderLayer(vllm_config, config.layer_types[i], prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(input_ids)
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.get_input_embeddings(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, positions)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_body_weights(self, self.config.num_experts, weights)


def load_body_weights(module: nn.Module, num_experts: int, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load a Qwen3-Next body (the target's ``model.*`` or the MTP draft's ``mtp.*``, names relative to ``module``):
    q/k/v and gate/up stacked, experts through ``FusedMoE``'s mapping, ``mtp.`` names skipped. Returns the names
    loaded."""
    stacked = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    experts = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj",
        ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj",
        num_experts=num_experts,
    )
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, weight in weights:
        if "rotary_emb.inv_freq" in name or name.startswith("mtp."):
            continue
        for param_name, shard_name, shard_id in stacked:
            if shard_name not in name or "mlp.experts" in name:
                continue
            name = name.replace(shard_name, param_name)
            if name not in params:
                continue
            stacked_param: Any = params[name]  # vLLM's parameters carry their weight_loader
            stacked_param.weight_loader(stacked_param, weight, shard_id)
            break
        else:
            for param_name, weight_name, expert_id, shard_id in experts:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                expert_param: Any = params[name]
                expert_param.weight_loader(expert_param, weight, name, shard_id=shard_id, expert_id=expert_id)
                break
            else:
                if name.endswith(".bias") and name not in params:  # a quantised checkpoint's extra bias
                    continue
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
        loaded.add(name)
    return loaded


class NPUQwen3NextForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """``Qwen3NextForCausalLM`` served by vllm-npu (see the module docstring)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("Qwen3-Next with pipeline parallelism is not served by vllm-npu; use TP")
        self.config = config
        self.model = NPUQwen3NextModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        return out

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype
        )

    @classmethod
    def get_mamba_state_shape_from_config(
        cls, vllm_config: VllmConfig, use_v1: bool = True
    ) -> tuple[tuple[int, int], tuple[int, int, int]]:
        hf = vllm_config.model_config.hf_config
        shapes: tuple[tuple[int, int], tuple[int, int, int]] = MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size,
            hf.linear_num_key_heads,
            hf.linear_num_value_heads,
            hf.linear_key_head_dim,
            hf.linear_value_head_dim,
            hf.linear_conv_kernel_dim,
            num_speculative_tokens(vllm_config),
        )
        return shapes

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits: torch.Tensor | None = self.logits_processor(self.lm_head, hidden_states)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ["mtp."] + (["lm_head."] if self.config.tie_word_embeddings else [])
        return AutoWeightsLoader(self, skip_prefixes=skip).load_weights(weights)
