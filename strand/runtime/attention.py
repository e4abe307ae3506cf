"""Attention backends over the paged KV pool, chosen by name.

The model calls `backend.forward(q, k, v, layer_id)` once per layer; everything that depends only
on the batch (index tables, masks) is built once per pass in `init_forward_metadata`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from strand.runtime.forward_batch import ForwardBatch
from strand.runtime.memory_pool import KVPool


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int):
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build per-pass tables from `batch`. Called once before the layers run; mutates only self."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Store k, v at the batch's `out_cache_loc` in layer `layer_id` of the pool, then attend.

        q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim].
        Each token sees its own request's KV up to and including its own position (causal).
        """


class TorchAttnBackend(AttentionBackend):
    """Plain torch SDPA: correct for every case, and the reference for the Triton backend.

    Decodes run as one padded batch (one gather of K/V per layer for all of them); extends run per
    request, since each has its own causal shape over its cached prefix.
    """

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.batch = batch
        ne = batch.num_extends
        seq_lens = batch.seq_lens
        table = batch.req_to_token
        # Extends: (token offset, length, kv slots, causal mask) per request.
        self.extends = []
        offset = 0
        for i in range(ne):
            n, total = batch.extend_lens[i], seq_lens[i]
            slots = table[batch.req_pool_indices[i], :total]  # [total]
            prefix = total - n
            mask = None
            if n > 1:
                # query j (absolute position prefix + j) sees keys 0 .. prefix + j
                mask = torch.ones(n, total, dtype=torch.bool).tril(diagonal=prefix)
            self.extends.append((offset, n, slots, mask))
            offset += n
        self.decode_offset = offset
        nd = batch.batch_size - ne
        self.num_decodes = nd
        if nd:
            dec_lens = torch.tensor(seq_lens[ne:], dtype=torch.int64)
            max_len = int(dec_lens.max())
            rows = torch.tensor(batch.req_pool_indices[ne:], dtype=torch.int64)
            idx = table[rows, :max_len]  # [nd, max_len]
            valid = torch.arange(max_len).unsqueeze(0) < dec_lens.unsqueeze(1)  # [nd, max_len]
            # flat slot list for one index_select per layer (far faster than 2-D fancy indexing)
            self.decode_slots = torch.where(valid, idx, torch.zeros_like(idx)).flatten()  # pad -> slot 0
            self.decode_max_len = max_len
            self.decode_mask = torch.zeros(nd, 1, 1, max_len).masked_fill(~valid[:, None, None, :], float("-inf"))

    def forward(self, q, k, v, layer_id):
        pool = self.pool
        pool.store(layer_id, self.batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        T = q.shape[0]
        out = torch.empty(T, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for offset, n, slots, mask in self.extends:
            qi = q[offset:offset + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_buf.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, KV, total, D]
            vi = v_buf.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            out[offset:offset + n] = o[0].transpose(0, 1)
        if self.num_decodes:
            out[self.decode_offset:] = self._decode(q[self.decode_offset:], k_buf, v_buf)
        return out.reshape(T, self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
        """All decodes at once, padded to the longest; heads grouped by KV head, no KV repeat.

        Computed in fp32 (a bf16 batched matmul is slow on CPUs); the gather's copy does the cast.
        """
        nd, L, KV, D = q.shape[0], self.decode_max_len, self.num_kv_heads, self.head_dim

        def gather(buf: torch.Tensor) -> torch.Tensor:  # -> [nd, KV, L, D] fp32, contiguous
            g = buf.index_select(0, self.decode_slots).view(nd, L, KV, D).permute(0, 2, 1, 3)
            return g.to(torch.float32, memory_format=torch.contiguous_format)

        qg = q.float().view(nd, KV, self.num_heads // KV, D)  # q head h = g * rep + r
        o = F.scaled_dot_product_attention(qg, gather(k_buf), gather(v_buf), attn_mask=self.decode_mask,
                                           scale=self.scale)  # [nd, KV, rep, D]
        return o.reshape(nd, self.num_heads, D).to(q.dtype)


def create_attention_backend(name: str, pool: KVPool, num_heads: int, num_kv_heads: int,
                             head_dim: int, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "torch"  # the Triton backend is a separate piece of work; torch is correct everywhere
    if name == "torch":
        return TorchAttnBackend(pool, num_heads, num_kv_heads, head_dim)
    if name == "triton":
        try:
            from strand.runtime.triton_backend import TritonAttnBackend
        except ImportError as e:
            raise ValueError(f"attention_backend: triton is not available here ({e})") from None
        return TritonAttnBackend(pool, num_heads, num_kv_heads, head_dim)
    raise ValueError(f"attention_backend: unknown {name!r} (torch | triton)")
