"""Reading weights: Hugging Face safetensors folders and GGUF files, into HF-named fp tensors.

Both paths end in the same place: a ModelConfig and a dict of HF-style names -> torch tensors
(`model.layers.0.self_attn.q_proj.weight`, ...), which the model then fuses and casts.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np
import torch

from strand.runtime.model_config import ModelConfig, ModelLoadError, is_gguf

_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}

# GGUF tensor names (per block) -> HF names.
_GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def load_model_weights(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, HF-named float tensors) from a resolved model path (folder or .gguf)."""
    if is_gguf(path):
        return _load_gguf(path)
    config = ModelConfig.from_hf_folder(path)
    return config, dict(_iter_safetensors(path))


def _iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"model_path: {folder!r} holds no *.safetensors files")
    for name in files:
        try:
            tensors = load_file(os.path.join(folder, name))
        except Exception as e:
            raise ModelLoadError(f"{os.path.join(folder, name)}: cannot read safetensors: {e}") from None
        yield from tensors.items()


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise ModelLoadError(f"model_path: {path!r} is not a readable GGUF file: {e}") from None
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCHS)}")

    def meta(key, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    num_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tensors_by_name = {t.name: t for t in reader.tensors}
    vocab = meta("vocab_size") or int(tensors_by_name["token_embd.weight"].shape[-1])
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        arch=_GGUF_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=int(num_heads),
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors_by_name,
        attention_bias="blk.0.attn_q.bias" in tensors_by_name,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
    )

    state: dict[str, torch.Tensor] = {}
    for name, t in tensors_by_name.items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _GGUF_BLOCK_NAMES:
                continue
            hf_name = f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[rest]}"
        elif name in _GGUF_TOP_NAMES:
            hf_name = _GGUF_TOP_NAMES[name]
        else:
            continue
        # dequantize gives numpy in row-major HF orientation: [out_features, in_features].
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        tensor = torch.from_numpy(array.reshape([int(d) for d in reversed(t.shape)]).copy())
        if config.arch == "llama" and rest_is(name, ("attn_q.weight", "attn_q.bias")):
            tensor = _unpermute_rope(tensor, config.num_heads)
        elif config.arch == "llama" and rest_is(name, ("attn_k.weight", "attn_k.bias")):
            tensor = _unpermute_rope(tensor, config.num_kv_heads)
        state[hf_name] = tensor
    return config, state


def rest_is(name: str, suffixes: tuple[str, ...]) -> bool:
    return name.startswith("blk.") and name.split(".", 2)[2] in suffixes


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row permutation of Q/K back to HF's rotate-half layout."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
