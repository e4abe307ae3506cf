"""Owns the model, the KV pool and the attention backend; runs one forward pass per call."""

from __future__ import annotations

import logging
import os
import time

import torch

from strand.runtime.attention import create_attention_backend
from strand.runtime.forward_batch import ForwardBatch
from strand.runtime.memory_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from strand.runtime.model_config import ModelConfig, resolve_model_path
from strand.runtime.models.llama import LlamaForCausalLM
from strand.runtime.server_args import ServerArgs
from strand.runtime.weights import load_model_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_GB = 2.0


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but no GPU is visible")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 on the CPU keeps outputs identical to the transformers reference; bf16 on GPUs.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.device = pick_device(args.device)
        if self.device.type == "cpu":
            torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
        self.dtype = pick_dtype(args.dtype, self.device)
        self.model_path = resolve_model_path(args.model_path)

        t0 = time.perf_counter()
        config, state = load_model_weights(self.model_path)
        self.config: ModelConfig = config
        self.context_length = min(args.context_length or config.max_position_embeddings,
                                  config.max_position_embeddings)
        model = LlamaForCausalLM(config, max_positions=self.context_length)
        model.load_hf_state_dict(state)
        del state
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        # RoPE tables stay fp32 for accuracy; they are cast per pass.
        self.model.rope_cos = self.model.rope_cos.float()
        self.model.rope_sin = self.model.rope_sin.float()
        logger.info("loaded %s (%s, %d layers) in %.1fs as %s on %s", self.model_path, config.arch,
                    config.num_layers, time.perf_counter() - t0, self.dtype, self.device)

        # On CPUs the KV pool stays fp32 whatever the weights: attention runs in fp32 there (a bf16
        # batched matmul is slow on CPUs), and a pool in that dtype needs no cast per gather.
        self.kv_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.max_total_tokens = self._kv_pool_size()
        self.kv_pool = KVPool(self.max_total_tokens, config.num_layers, config.num_kv_heads,
                              config.head_dim, self.kv_dtype, self.device)
        self.allocator = TokenSlotAllocator(self.max_total_tokens, self.device)
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests + 8, self.context_length + 8,
                                                self.device)
        self.attn = create_attention_backend(args.attention_backend, self.kv_pool, config.num_heads,
                                             config.num_kv_heads, config.head_dim, self.device)
        logger.info("KV pool: %d tokens", self.max_total_tokens)

    def _kv_pool_size(self) -> int:
        a, c = self.args, self.config
        per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.kv_dtype)
        if a.max_total_tokens is not None:
            if a.max_total_tokens < 1:
                raise ValueError("max_total_tokens: must be >= 1")
            return a.max_total_tokens
        if a.kv_cache_memory_gb is not None:
            budget = a.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = total * a.mem_fraction_static - used_by_others
        else:
            budget = CPU_DEFAULT_KV_GB * 2**30
        return max(int(budget // per_token), 256)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self.attn)
