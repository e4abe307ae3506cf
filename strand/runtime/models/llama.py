"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) over the paged KV pool.

One file, read top to bottom. Q/K/V and gate/up are fused into single matmuls; RoPE cos/sin are
gathered once per pass and shared by every layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from strand.runtime.attention import AttentionBackend
from strand.runtime.forward_batch import ForwardBatch
from strand.runtime.model_config import ModelConfig, ModelLoadError


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    if rs["rope_type"] == "linear":
        return inv_freq / rs["factor"]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]; cos/sin [T, 1, D] (rotate-half layout, as HF stores Q/K)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.eps = c.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.ones(c.hidden_size), requires_grad=False)
        self.qkv = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        T = h.shape[0]
        x = F.rms_norm(h, (h.shape[-1],), self.input_norm, self.eps)
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(T, self.num_heads, self.head_dim), cos, sin)  # [T, H, D]
        k = apply_rope(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)  # [T, KV, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        h = h + self.o_proj(attn.forward(q, k, v, self.layer_id))
        x = F.rms_norm(h, (h.shape[-1],), self.post_attn_norm, self.eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq = rope_inv_freq(config)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [max_positions, D]
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in float32."""
        attn.init_forward_metadata(batch)
        h = self.embed(batch.input_ids)  # [T, hidden]
        cos = self.rope_cos[batch.positions].unsqueeze(1).to(h.dtype)  # [T, 1, D]
        sin = self.rope_sin[batch.positions].unsqueeze(1).to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, attn)
        h = h[batch.logits_indices]
        h = F.rms_norm(h, (h.shape[-1],), self.norm, self.config.rms_norm_eps)
        return self.lm_head(h).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be filled."""
        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ModelLoadError(f"weights: missing tensor {name!r}")
            return state[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ModelLoadError(f"weights: {name} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(value)

        with torch.no_grad():
            put(self.embed.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
            put(self.norm, take("model.norm.weight"), "model.norm.weight")
            head = state.get("lm_head.weight")
            if head is None or self.config.tie_word_embeddings:
                head = take("model.embed_tokens.weight")
            put(self.lm_head.weight, head, "lm_head.weight")
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                put(layer.input_norm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
                put(layer.post_attn_norm, take(p + "post_attention_layernorm.weight"),
                    p + "post_attention_layernorm.weight")
                qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
                put(layer.qkv.weight, qkv, p + "self_attn.qkv_proj.weight")
                if layer.qkv.bias is not None:
                    bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                    put(layer.qkv.bias, bias, p + "self_attn.qkv_proj.bias")
                put(layer.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
                gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                put(layer.gate_up.weight, gate_up, p + "mlp.gate_up_proj.weight")
                put(layer.down.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
