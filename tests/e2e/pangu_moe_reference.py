# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""An independent float64 implementation of Pangu Pro MoE, the reference of the PanguProMoE engine tests (no HF
class exists for the model).

Written from the architecture's description, over the checkpoint's tensors by name, with none of the plugin's or
vLLM's code: no KV cache (every step recomputes the whole sequence), plain per-head causal attention, and MoGE routing
as an explicit loop over the expert groups (each token takes the argmax of its softmax scores inside every group,
weighted by score times ``router_scale``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

F64 = torch.float64


class PanguReference:
    """Greedy decoding of a checkpoint from ``npu_testkit.pangu.build_tiny_pangu`` in float64 on the CPU."""

    def __init__(self, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = {name: t.to(F64) for name, t in tensors.items()}
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg["num_key_value_heads"]
        self.head_dim = cfg["hidden_size"] // self.heads
        self.eps = cfg["rms_norm_eps"]
        self.groups = cfg["num_experts_per_tok"]  # one activated expert per group
        self.experts = cfg["num_experts"]

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _linear(self, x: torch.Tensor, name: str, bias: bool = False) -> torch.Tensor:
        y = x @ self.w[f"{name}.weight"].T
        return y + self.w[f"{name}.bias"] if bias else y

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """x [heads, S, d]: rotate pairs (i, i + d/2) by position * theta^(-2i/d) (the rotate-half layout)."""
        d, seq = self.head_dim, x.shape[1]
        inv_freq = self.cfg["rope_theta"] ** (-torch.arange(0, d, 2, dtype=F64) / d)
        angle = torch.arange(seq, dtype=F64)[:, None] * inv_freq[None, :]
        cos, sin = angle.cos(), angle.sin()
        first, second = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    def _attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        seq, d = x.shape[0], self.head_dim
        q = self._linear(x, f"{p}.q_proj", True).view(seq, self.heads, d).transpose(0, 1)
        k = self._linear(x, f"{p}.k_proj", True).view(seq, self.kv_heads, d).transpose(0, 1)
        v = self._linear(x, f"{p}.v_proj", True).view(seq, self.kv_heads, d).transpose(0, 1)
        q, k = self._rope(q), self._rope(k)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        per_kv = self.heads // self.kv_heads
        out = torch.empty(self.heads, seq, d, dtype=F64)
        for h in range(self.heads):
            scores = (q[h] @ k[h // per_kv].T) / math.sqrt(d)
            out[h] = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v[h // per_kv]
        return self._linear(out.transpose(0, 1).reshape(seq, self.heads * d), f"{p}.o_proj", True)

    def _swiglu(self, x: torch.Tensor, p: str) -> torch.Tensor:
        gate, up = self._linear(x, f"{p}.gate_proj"), self._linear(x, f"{p}.up_proj")
        return self._linear(torch.nn.functional.silu(gate) * up, f"{p}.down_proj")

    def route(self, logits: torch.Tensor, router_scale: torch.Tensor) -> list[list[tuple[int, float]]]:
        """Per token: [(expert id, weight)] with one entry per group, by explicit loops."""
        size = self.experts // self.groups
        scale = router_scale.reshape(-1).tolist()
        chosen = []
        for probs in torch.softmax(logits, dim=-1).tolist():
            row = []
            for g in range(self.groups):
                best = max(range(g * size, (g + 1) * size), key=lambda e: probs[e])
                row.append((best, probs[best] * scale[best]))
            chosen.append(row)
        return chosen

    def _moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        out = self._swiglu(x, f"{p}.shared_expert") if f"{p}.shared_expert.gate_proj.weight" in self.w else 0 * x
        # Every expert on every token (tiny sizes), then each token adds the ones it routed to.
        expert_out = [self._swiglu(x, f"{p}.experts.{e}") for e in range(self.experts)]
        for t, row in enumerate(self.route(self._linear(x, f"{p}.gate"), self.w[f"{p}.router_scale"])):
            for expert, weight in row:
                out[t] += weight * expert_out[expert][t]
        return out

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits [vocab] (float64) after ``ids``."""
        x = self.w["model.embed_tokens.weight"][torch.tensor(list(ids))]
        for n in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{n}"
            x = x + self._attention(self._rms(x, f"{p}.input_layernorm.weight"), f"{p}.self_attn")
            x = x + self._moe(self._rms(x, f"{p}.post_attention_layernorm.weight"), f"{p}.mlp")
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return self._rms(x[-1:], "model.norm.weight")[0] @ head.T

    def greedy(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], float]:
        """``max_tokens`` greedy tokens after ``prompt`` and the smallest top-1/top-2 logit gap met on the way."""
        ids, out, gap = list(prompt), [], math.inf
        # One thread: these matmuls are tiny, and on a loaded 2-core host torch's thread pool makes them ~30x slower.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(max_tokens):
                top = self.logits(ids).topk(2)
                gap = min(gap, float(top.values[0] - top.values[1]))
                out.append(int(top.indices[0]))
                ids.append(out[-1])
        finally:
            torch.set_num_threads(threads)
        return out, gap
