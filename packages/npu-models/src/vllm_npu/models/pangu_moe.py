# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Pangu Pro MoE (``PanguProMoEForCausalLM``) for vLLM 0.11, which has no model class for it.

Built from vLLM's layer classes, so on our platform every piece runs on the plugin's overrides: ``RMSNorm``,
``get_rope``, ``SiluAndMul``, ``VocabParallelEmbedding`` and ``FusedMoE`` through npu-ops' CustomOp registrations,
``Attention`` on npu-attention's backend. Per decoder layer::

    h = x + o_proj(attention(rope(q, k), v))        # q/k/v/o projections with bias, GQA, head dim = H / heads
    y = h + shared_expert(n) + sum_j w_j * expert_{e_j}(n)     with n = rms_norm(h)

Routing is MoGE (:func:`moge_select_experts`): the experts form ``num_experts_per_tok`` groups of consecutive ids,
and each token takes the best expert of every group, weighted by its softmax score (over all experts) times the
layer's learned ``router_scale``; no renormalisation. Expert parallelism with the linear placement then gives every
rank the same number of (token, expert) pairs whenever the group count is a multiple of the EP size, which is the
point of the design. Tensor parallelism splits the attention heads and, without EP, each expert's intermediate
dimension; the routed and shared outputs are summed once, by one all-reduce per MoE block.

No fused NPU op computes this routing: ``npu_moe_gating_top_k`` (torch_npu 2.8.0) keeps whole groups and then takes
the top-k over them, with no per-group quota, so the routing is plain torch on both backends (as in vllm-ascend).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.attention import Attention
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors
from vllm_npu.interface import ConfigError

from .pangu_config import PanguProMoEConfig

# --- MoGE routing ---------------------------------------------------------------------------------------------


def check_moge_shape(num_experts: int, top_k: int, num_groups: int) -> None:
    """Raise :class:`ConfigError` unless ``num_experts`` experts split into ``num_groups`` equal groups from which
    ``top_k`` experts can be taken in equal shares."""
    if num_groups <= 0 or num_experts % num_groups or top_k % num_groups:
        raise ConfigError(
            f"MoGE routing needs num_experts={num_experts} and top_k={top_k} both divisible by the group count "
            f"{num_groups}; fix num_experts / num_experts_per_tok in the model config"
        )
    if top_k // num_groups > num_experts // num_groups:
        raise ConfigError(f"MoGE routing: top_k={top_k} exceeds num_experts={num_experts}")


def moge_select_experts(
    router_logits: torch.Tensor, router_scale: torch.Tensor, *, top_k: int, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-Grouped-Experts top-k.

    ``router_logits`` [T, E] (any float dtype), ``router_scale`` [E] or [1, E]. Scores are ``softmax(logits)`` over
    all E experts (float32); the experts ``g*E/G .. (g+1)*E/G - 1`` form group g of G = ``num_groups``; each token
    takes the ``top_k / G`` best-scoring experts of every group. Returns ``(weights [T, top_k] float32, ids [T,
    top_k] int32)`` with ``weights = score * router_scale[id]``; the entries are ordered by group, then by
    descending score inside a group.
    """
    num_tokens, num_experts = router_logits.shape
    check_moge_shape(num_experts, top_k, num_groups)
    group_size = num_experts // num_groups
    scores = torch.softmax(router_logits.float(), dim=-1)
    best, local = scores.view(num_tokens, num_groups, group_size).topk(top_k // num_groups, dim=-1)
    offsets = torch.arange(num_groups, device=local.device).mul_(group_size).view(1, num_groups, 1)
    ids = (local + offsets).reshape(num_tokens, top_k)
    scale = router_scale.reshape(-1).float().index_select(0, ids.reshape(-1)).view(num_tokens, top_k)
    return best.reshape(num_tokens, top_k) * scale, ids.to(torch.int32)


class MoGERouting:
    """vLLM ``FusedMoE`` ``custom_routing_function`` for one MoGE block: :func:`moge_select_experts` with the
    block's ``router_scale`` parameter (read at call time, so the loaded values are used)."""

    def __init__(self, router_scale: nn.Parameter, num_groups: int) -> None:
        self.router_scale = router_scale
        self.num_groups = num_groups

    def __call__(
        self, hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if renormalize:
            raise ValueError("MoGE routing does not renormalise its weights; build the FusedMoE with renormalize=False")
        return moge_select_experts(gating_output, self.router_scale, top_k=topk, num_groups=self.num_groups)


# --- layers ---------------------------------------------------------------------------------------------------


class PanguProMoEMLP(nn.Module):
    """SwiGLU MLP (gate/up merged, no bias); the shared expert. ``reduce_results=False`` leaves the TP sum to the
    caller."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        quant_config: QuantizationConfig | None,
        reduce_results: bool,
        prefix: str,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ConfigError(f"PanguProMoE: hidden_act={hidden_act!r} is not supported; only 'silu' is")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            quant_config=quant_config,
            reduce_results=reduce_results,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class PanguProMoESparseMoeBlock(nn.Module):
    """Gate (replicated, no bias) -> MoGE routing -> routed experts (``FusedMoE``) + shared expert, one all-reduce."""

    def __init__(self, config: PanguProMoEConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        num_experts, top_k = config.num_experts, config.num_experts_per_tok
        # One group per activated expert: the published model's 64 experts in 8 groups with top-8.
        check_moge_shape(num_experts, top_k, top_k)
        self.router_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.router_scale.weight_loader = _load_router_scale  # type: ignore[attr-defined]
        self.gate = ReplicatedLinear(
            config.hidden_size, num_experts, bias=False, quant_config=None, prefix=f"{prefix}.gate"
        )
        self.experts = FusedMoE(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            reduce_results=False,
            renormalize=False,
            quant_config=quant_config,
            custom_routing_function=MoGERouting(self.router_scale, num_groups=top_k),
            prefix=f"{prefix}.experts",
        )
        self.shared_expert: PanguProMoEMLP | None = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = PanguProMoEMLP(
                config.hidden_size,
                config.shared_expert_intermediate_size,
                config.hidden_act,
                quant_config,
                reduce_results=self.experts.must_reduce_shared_expert_outputs(),
                prefix=f"{prefix}.shared_expert",
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits, _ = self.gate(hidden_states)
        out = self.experts(hidden_states=hidden_states, router_logits=router_logits)
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden_states)
        if self.tp_size > 1:
            out = self.experts.maybe_all_reduce_tensor_model_parallel(out)
        return out


def _load_router_scale(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Checkpoints store ``router_scale`` as [1, E] (some as [E]); the parameter is [E]."""
    if loaded.numel() != param.numel():
        raise ValueError(f"router_scale of {tuple(loaded.shape)} does not fit {param.numel()} experts")
    param.data.copy_(loaded.reshape(param.shape))


class PanguProMoEAttention(nn.Module):
    """GQA self-attention with biased q/k/v and o projections and RoPE over the whole head."""

    def __init__(
        self,
        config: PanguProMoEConfig,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % tp_size or (kv_heads % tp_size and tp_size % kv_heads):
            raise ConfigError(
                f"PanguProMoE: {heads} attention heads / {kv_heads} KV heads do not split over "
                f"tensor_parallel_size={tp_size}"
            )
        self.head_dim = config.hidden_size // heads
        self.num_heads = heads // tp_size
        self.num_kv_heads = max(1, kv_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            heads,
            kv_heads,
            bias=True,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            heads * self.head_dim, config.hidden_size, bias=True, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim=self.head_dim,
            max_position=config.max_position_embeddings,
            base=config.rope_theta,
            rope_scaling=getattr(config, "rope_scaling", None),
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class PanguProMoEDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PanguProMoEConfig,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.self_attn = PanguProMoEAttention(config, cache_config, quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = PanguProMoESparseMoeBlock(config, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The fused add+norm form carries the residual stream: (x + residual, norm(x + residual)).
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


# Explicit dims: this module's annotations are strings (PEP 563), which the decorator's inference cannot read.
@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class PanguProMoEModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        # A PanguProMoEConfig, or the checkpoint's own class under --trust-remote-code (same fields).
        config: Any = vllm_config.model_config.hf_config
        _check_config(config)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            PanguProMoEDecoderLayer(
                config, vllm_config.cache_config, vllm_config.quant_config, prefix=f"{prefix}.layers.{i}"
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.get_input_embeddings(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def _check_config(config: Any) -> None:
    if getattr(config, "mlp_only_layers", None):
        raise ConfigError(
            f"PanguProMoE: mlp_only_layers={config.mlp_only_layers} (dense layers) is not supported; every decoder "
            "layer of this model is a MoGE block"
        )
    if config.hidden_size % config.num_attention_heads:
        raise ConfigError(
            f"PanguProMoE: hidden_size={config.hidden_size} is not a multiple of "
            f"num_attention_heads={config.num_attention_heads} (the head dim is their quotient)"
        )


# Checkpoint name piece -> (our parameter's name piece, shard id) for the merged projections.
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class AscendPanguProMoEForCausalLM(nn.Module):
    """vLLM model class registered for ``PanguProMoEForCausalLM`` checkpoints (config: :class:`PanguProMoEConfig`).

    Checkpoint names: ``model.embed_tokens.weight``, ``model.layers.N.{input,post_attention}_layernorm.weight``,
    ``model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}``, ``model.layers.N.mlp.gate.weight`` [E, H],
    ``model.layers.N.mlp.router_scale`` [1, E], ``model.layers.N.mlp.experts.M.{gate,up,down}_proj.weight``,
    ``model.layers.N.mlp.shared_expert.{gate,up,down}_proj.weight``, ``model.norm.weight``, ``lm_head.weight``.
    """

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = PanguProMoEModel(vllm_config=vllm_config, prefix=_join(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=_join(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (names in the class docstring); returns the parameter names loaded.

        Experts another EP rank owns are skipped by ``FusedMoE``'s loader; ``rotary_emb.inv_freq`` buffers and a tied
        ``lm_head.weight`` are ignored."""
        params = dict(self.named_parameters())
        expert_mapping = FusedMoE.make_expert_params_mapping(
            ckpt_gate_proj_name="gate_proj",
            ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj",
            num_experts=self.config.num_experts,
        )
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target = self._load_one(name, tensor, params, expert_mapping)
            loaded.add(target)
        return loaded

    def _load_one(
        self,
        name: str,
        tensor: torch.Tensor,
        params: dict[str, nn.Parameter],
        expert_mapping: list[tuple[str, str, int, str]],
    ) -> str:
        if ".mlp.experts." in name:
            for param_piece, ckpt_piece, expert_id, shard_id in expert_mapping:
                if ckpt_piece in name:
                    target = name.replace(ckpt_piece, param_piece)
                    param = _param(params, target, name)
                    param.weight_loader(param, tensor, target, shard_id=shard_id, expert_id=expert_id)  # type: ignore[attr-defined]
                    return target
            raise ValueError(f"PanguProMoE checkpoint tensor {name!r} names no known expert projection")
        for ckpt_piece, param_piece, stack_id in _STACKED:
            if ckpt_piece in name:
                target = name.replace(ckpt_piece, param_piece)
                param = _param(params, target, name)
                param.weight_loader(param, tensor, stack_id)  # type: ignore[attr-defined]
                return target
        param = _param(params, name, name)
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        return name


def _param(params: dict[str, nn.Parameter], target: str, ckpt_name: str) -> nn.Parameter:
    if target not in params:
        raise ValueError(
            f"PanguProMoE checkpoint tensor {ckpt_name!r} has no parameter {target!r} in the model; the checkpoint "
            "does not match PanguProMoEForCausalLM's layout (see its docstring)"
        )
    return params[target]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
