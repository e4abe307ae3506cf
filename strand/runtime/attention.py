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

    Extends run per request (each has its own causal shape over its cached prefix). Decodes run
    in a few padded groups of similar length (one gather and one SDPA per group and layer), with
    query heads grouped under their KV head so K/V are never repeated. Attention math runs in the
    pool's dtype, fp32 on CPUs.
    """

    DECODE_GROUP = 16  # decodes per padded group: fewer groups = fewer calls, more = less padding

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.batch = batch
        ne = batch.num_extends
        seq_lens = batch.seq_lens
        table = batch.req_to_token
        dtype = self.pool.dtype
        # Extends: (token offset, length, kv slots, mask or None for plain causal) per request.
        self.extends = []
        offset = 0
        for i in range(ne):
            n, total = batch.extend_lens[i], seq_lens[i]
            slots = table[batch.req_pool_indices[i], :total]  # [total]
            prefix = total - n
            mask = None
            if n > 1 and prefix:
                # query j (absolute position prefix + j) sees keys 0 .. prefix + j
                allowed = torch.ones(n, total, dtype=torch.bool).tril(diagonal=prefix)
                mask = torch.zeros(n, total, dtype=dtype).masked_fill(~allowed, float("-inf"))
            self.extends.append((offset, n, slots, mask))
            offset += n
        self.decode_offset = offset
        # Decodes: sorted by length, cut into groups, each padded to its own longest.
        self.decode_groups = []
        nd = batch.batch_size - ne
        if nd:
            lens = torch.tensor(seq_lens[ne:], dtype=torch.int64)
            order = torch.argsort(lens, descending=True)
            rows = torch.tensor(batch.req_pool_indices[ne:], dtype=torch.int64)
            for g in range(0, nd, self.DECODE_GROUP):
                members = order[g:g + self.DECODE_GROUP]  # [m] indices among the decodes
                glens = lens[members]
                max_len = int(glens[0])
                valid = torch.arange(max_len).unsqueeze(0) < glens.unsqueeze(1)  # [m, max_len]
                idx = table[rows[members], :max_len]
                slots = torch.where(valid, idx, torch.zeros_like(idx)).flatten()  # pad -> slot 0
                mask = torch.zeros(len(members), 1, 1, max_len, dtype=dtype)
                mask.masked_fill_(~valid[:, None, None, :], float("-inf"))
                self.decode_groups.append((members + offset, slots, max_len, mask))

    def forward(self, q, k, v, layer_id):
        pool = self.pool
        pool.store(layer_id, self.batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.k_buffer[layer_id], pool.v_buffer[layer_id]  # [KV, slots, D]
        T, H, D = q.shape
        KV = self.num_kv_heads
        gqa = H != KV
        model_dtype = q.dtype
        q = q.to(pool.dtype)
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
        for offset, n, slots, mask in self.extends:
            qi = q[offset:offset + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_buf.index_select(1, slots).unsqueeze(0)  # [1, KV, total, D]
            vi = v_buf.index_select(1, slots).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None and n > 1,
                                               scale=self.scale, enable_gqa=gqa)
            out[offset:offset + n] = o[0].transpose(0, 1)
        for rows, slots, max_len, mask in self.decode_groups:
            m = len(rows)
            qg = q.index_select(0, rows).view(m, KV, H // KV, D)  # q head h = g * rep + r
            kg = k_buf.index_select(1, slots).view(KV, m, max_len, D).transpose(0, 1)  # [m, KV, L, D]
            vg = v_buf.index_select(1, slots).view(KV, m, max_len, D).transpose(0, 1)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=self.scale)
            out.index_copy_(0, rows, o.reshape(m, H, D))
        return out.reshape(T, H * D).to(model_dtype)


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
