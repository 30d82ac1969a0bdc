# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen3-Next's gated delta-net (linear attention) layer on our GDN kernel pairs.

Same parameters, weight loading, KV-cache spec (``MambaBase``: a conv state ``[W - 1, D]`` and an SSM state
``[HV, K, V]`` per slot, vLLM's ``GDNAttentionBackend`` builds the metadata) and custom-op boundary
(``torch.ops.vllm.gdn_attention``, one of vLLM's piecewise splitting ops) as vLLM 0.11's ``Qwen3NextGatedDeltaNet``;
the forward runs :mod:`.gdn_conv`, :mod:`.gdn_delta` and :mod:`.gdn_norm` instead of the FLA Triton kernels, and this
module does not import vLLM's ``qwen3_next`` (whose import fails on a host without a working Triton: its FLA modules
read ``tl.exp`` at import). The op is vLLM's where its module can be imported (a working Triton), else registered here
with the same body (dispatch to the layer's ``_forward``).

Speculative decoding (Qwen3-Next's MTP draft, :mod:`.qwen3_next_mtp`): a verification step carries ``1 + k`` tokens
per decoding request (fewer when drafts were cut); the layer splits them from the prefill/plain-decode tokens by
vLLM's ``GDNAttentionMetadata`` masks, as vLLM's ``_forward`` does, and runs the conv update and the fused recurrent
rule with the per-request accepted counts of the previous step. The conv state grows to ``W - 1 + k`` columns and each
request owns ``1 + k`` recurrent-state slots (vLLM's ``num_speculative_blocks``), one per verified token.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from vllm.config import CacheConfig, ModelConfig, get_current_vllm_config
from vllm.distributed import divide, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm_npu.interface import ConfigError

from .gdn_conv import CAUSAL_CONV1D_PREFILL, CAUSAL_CONV1D_UPDATE
from .gdn_delta import CHUNK_GATED_DELTA_RULE, FUSED_RECURRENT_GATED_DELTA_RULE
from .gdn_norm import GDN_GATING, RMS_NORM_GATED


def _gdn_attention(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    layer = get_forward_context().no_compile_layers[layer_name]
    layer._forward(hidden_states=hidden_states, output=output)


def _gdn_attention_fake(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


def ensure_gdn_op() -> None:
    """Make ``torch.ops.vllm.gdn_attention`` exist exactly once per process (vLLM's, or ours with its body)."""
    if hasattr(torch.ops.vllm, "gdn_attention"):
        return
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # vLLM's module imports cleanly and registers the op; registering ours too would clash
        import vllm.model_executor.models.qwen3_next  # noqa: F401

        return
    from vllm.utils import direct_register_custom_op

    direct_register_custom_op(
        op_name="gdn_attention", op_func=_gdn_attention, mutates_args=["output"], fake_impl=_gdn_attention_fake
    )


def num_speculative_tokens(vllm_config: Any) -> int:
    """``k``, the draft tokens verified per step (0 without a speculative config)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(spec.num_speculative_tokens) if spec is not None else 0


class NPUQwen3NextGatedDeltaNet(nn.Module, MambaBase):
    """The linear-attention mixer of one Qwen3-Next decoder layer (the parameters of HF's ``Qwen3NextGatedDeltaNet``:
    ``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``)."""

    @property
    def mamba_type(self) -> str:
        return "linear_attention"

    def get_attn_backend(self) -> Any:
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

        return GDNAttentionBackend

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        assert self.model_config is not None and self.cache_config is not None
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype
        )

    def get_state_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            self.tp_size,
            self.num_k_heads,
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
            self.conv_kernel_size,
            self.num_spec,
        )

    def __init__(
        self,
        config: Any,
        model_config: ModelConfig | None = None,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        ensure_gdn_op()
        self.tp_size = get_tensor_model_parallel_world_size()
        tp_rank = get_tensor_model_parallel_rank()
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        if config.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"Qwen3-Next GDN layer {prefix}: hidden_act {config.hidden_act!r} is not silu")
        self.activation = config.hidden_act
        self.eps = config.rms_norm_eps
        self.prefix = prefix
        self.model_config = model_config
        self.cache_config = cache_config
        self.num_spec = num_speculative_tokens(get_current_vllm_config())
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = ColumnParallelLinear(
            input_size=self.conv_kernel_size, output_size=self.conv_dim, bias=False, prefix=f"{prefix}.conv1d"
        )
        conv_weight = cast(torch.Tensor, self.conv1d.weight)
        conv_weight.data = conv_weight.data.unsqueeze(1)  # [D, 1, W]: HF's nn.Conv1d layout, as vLLM keeps it
        self.in_proj_qkvz = ColumnParallelLinear(
            config.hidden_size,
            self.key_dim * 2 + self.value_dim * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.in_proj_qkvz",
        )
        self.in_proj_ba = ColumnParallelLinear(
            config.hidden_size,
            self.num_v_heads * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.in_proj_ba",
        )
        # The checkpoint's conv1d weight is [q | k | v] channels: each part is sharded over the ranks on its own.
        delattr(conv_weight, "weight_loader")
        qk, v = (self.key_dim, 0, False), (self.value_dim, 0, False)
        set_weight_attrs(
            conv_weight, {"weight_loader": mamba_v2_sharded_weight_loader([qk, qk, v], self.tp_size, tp_rank)}
        )
        local_v_heads = divide(self.num_v_heads, self.tp_size)
        self.dt_bias = nn.Parameter(torch.ones(local_v_heads))
        self.A_log = nn.Parameter(torch.empty(local_v_heads, dtype=torch.float32))
        set_weight_attrs(self.A_log, {"weight_loader": sharded_weight_loader(0)})
        set_weight_attrs(self.dt_bias, {"weight_loader": sharded_weight_loader(0)})
        self.norm = nn.Module()  # HF's Qwen3NextRMSNormGated holds only ``weight`` (ones at init)
        self.norm.weight = nn.Parameter(torch.ones(self.head_v_dim, dtype=config.torch_dtype))
        self.out_proj = RowParallelLinear(
            self.value_dim,
            config.hidden_size,
            bias=False,
            input_is_parallel=True,
            quant_config=quant_config,
            prefix=f"{prefix}.out_proj",
        )
        self._conv_prefill = CAUSAL_CONV1D_PREFILL.select()
        self._conv_update = CAUSAL_CONV1D_UPDATE.select()
        self._chunk = CHUNK_GATED_DELTA_RULE.select()
        self._recurrent = FUSED_RECURRENT_GATED_DELTA_RULE.select()
        self._norm = RMS_NORM_GATED.select()
        self._gating = GDN_GATING.select()
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def _split_projections(
        self, qkvz: torch.Tensor, ba: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """HF's ``fix_query_key_value_ordering``: the projections are grouped per key head ``[q k v z]`` / ``[b a]``;
        returns q, k ``[T, H, K]``, v, z ``[T, HV, V]``, b, a ``[T, HV]`` (this rank's heads)."""
        tokens = qkvz.shape[0]
        heads = self.num_k_heads // self.tp_size
        per = self.num_v_heads // self.num_k_heads
        qkvz = qkvz.view(tokens, heads, -1)
        ba = ba.view(tokens, heads, -1)
        q, k, v, z = torch.split(
            qkvz, [self.head_k_dim, self.head_k_dim, per * self.head_v_dim, per * self.head_v_dim], dim=2
        )
        b, a = torch.split(ba, [per, per], dim=2)
        return (
            q,
            k,
            v.reshape(tokens, -1, self.head_v_dim),
            z.reshape(tokens, -1, self.head_v_dim),
            b.reshape(tokens, -1),
            a.reshape(tokens, -1),
        )

    def forward(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        torch.ops.vllm.gdn_attention(hidden_states, output, self.prefix)

    def _forward(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        context = get_forward_context()
        meta: Any = context.attn_metadata  # {layer name: GDNAttentionMetadata}
        if meta is None:  # profile run: no cache bound yet
            return
        assert isinstance(meta, dict)
        meta = meta[self.prefix]
        cache = self.kv_cache[context.virtual_engine]
        conv_state, ssm_state = cache[0].transpose(-1, -2), cache[1]  # [slots, D, W - 1 + k], [slots, HV, K, V]
        tokens = meta.num_actual_tokens
        qkvz, _ = self.in_proj_qkvz(hidden_states[:tokens])
        ba, _ = self.in_proj_ba(hidden_states[:tokens])
        q, k, v, z, b, a = self._split_projections(qkvz, ba)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
        conv_weight = cast(torch.Tensor, self.conv1d.weight)
        weight = conv_weight.view(conv_weight.size(0), conv_weight.size(2))
        g, beta = self._gating(self.A_log, a, b, self.dt_bias)
        # Verification tokens (requests with drafts) vs the rest; a step with only verifications splits nothing.
        spec = meta.spec_sequence_masks is not None
        only_spec = spec and meta.num_prefills == 0 and meta.num_decodes == 0
        token_masks = meta.spec_token_masks[:tokens] if spec and not only_spec else None
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []  # (mixed, g, beta, is_spec)
        if only_spec:
            parts.append((mixed, g, beta, True))
        elif token_masks is not None:
            parts.append((mixed[token_masks], g[token_masks], beta[token_masks], True))
            parts.append((mixed[~token_masks], g[~token_masks], beta[~token_masks], False))
        else:
            parts.append((mixed, g, beta, False))
        outs = [
            self._mix(x, g_part, beta_part, is_spec, meta, conv_state, ssm_state, weight)
            for x, g_part, beta_part, is_spec in parts
        ]
        if token_masks is None:
            core = outs[0]
        else:
            core = outs[0].new_empty((tokens, *outs[0].shape[1:]))
            core[token_masks], core[~token_masks] = outs[0], outs[1]
        core = self._norm(
            core.reshape(-1, self.head_v_dim),
            z.reshape(-1, self.head_v_dim),
            cast(torch.Tensor, self.norm.weight),
            self.eps,
        )
        output[:tokens], _ = self.out_proj(core.reshape(tokens, -1))

    def _mix(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        is_spec: bool,
        meta: Any,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        """Conv + gated delta rule of one part of the step's tokens (``mixed`` ``[T, 2 * key + value]`` of this
        rank); returns the core output ``[T, HV, V]``."""
        if is_spec:  # 1 + k tokens per request, from the state its previous step's accepted tokens left
            n = meta.num_spec_decodes
            loc, slots = meta.spec_query_start_loc[: n + 1], meta.spec_state_indices_tensor
            accepted = meta.num_accepted_tokens
            mixed = self._conv_update(mixed, conv_state, weight, None, self.activation, slots, accepted, loc,
                                      slots.size(-1))  # fmt: skip
        elif meta.num_prefills > 0:
            loc, slots = meta.non_spec_query_start_loc, meta.non_spec_state_indices_tensor
            mixed = self._conv_prefill(
                mixed, weight, None, conv_state, loc, slots, meta.has_initial_state, self.activation
            )
        else:
            loc, slots = meta.non_spec_query_start_loc, meta.non_spec_state_indices_tensor
            mixed = self._conv_update(mixed, conv_state, weight, None, self.activation, slots)
        count = mixed.shape[0]
        key_part = self.key_dim // self.tp_size
        q, k, v = torch.split(mixed, [key_part, key_part, self.value_dim // self.tp_size], dim=-1)
        q, k = q.reshape(count, -1, self.head_k_dim), k.reshape(count, -1, self.head_k_dim)
        v = v.reshape(count, -1, self.head_v_dim)
        if is_spec:
            out: torch.Tensor = self._recurrent(q, k, v, g, beta, ssm_state, loc, slots, accepted, True)
        elif meta.num_prefills > 0:
            out = self._chunk(q, k, v, g, beta, ssm_state, loc, slots, meta.has_initial_state, True)
        else:
            out = self._recurrent(q, k, v, g, beta, ssm_state, loc, slots, None, True)
        return out
