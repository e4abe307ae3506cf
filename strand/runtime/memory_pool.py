"""The KV pool, the token-slot allocator and the request -> token table (PagedAttention at token grain)."""

from __future__ import annotations

import torch


class KVPool:
    """K and V for every layer, preallocated once, head-major: `[kv_heads, num_slots + 1, head_dim]`.

    Head-major so that gathering a request's slots gives `[kv_heads, len, head_dim]`, the layout
    attention consumes, with no transpose copy. Slot 0 is never handed out: padded index tables
    point at it, so a gather never reads outside the pool and the padding reads harmless zeros.
    """

    def __init__(self, num_slots: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.num_slots = num_slots
        self.dtype = dtype
        self.k_buffer = [torch.zeros(kv_heads, num_slots + 1, head_dim, dtype=dtype, device=device)
                         for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(kv_heads, num_slots + 1, head_dim, dtype=dtype, device=device)
                         for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots [T]; k, v [T, kv_heads, head_dim]
        self.k_buffer[layer_id][:, slots] = k.transpose(0, 1).to(self.dtype)
        self.v_buffer[layer_id][:, slots] = v.transpose(0, 1).to(self.dtype)


class TokenSlotAllocator:
    """Free list of KV slots (1..num_slots). `alloc` returns None when there are not enough."""

    def __init__(self, num_slots: int, device: torch.device | str = "cpu"):
        self.num_slots = num_slots
        self.device = device
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.num_slots + 1, dtype=torch.int64, device=self.device)
        self._pending: list[torch.Tensor] = []

    def _merge(self) -> None:
        if self._pending:
            self._free = torch.cat([self._free, *self._pending])
            self._pending = []

    @property
    def free_count(self) -> int:
        return len(self._free) + sum(len(p) for p in self._pending)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self._free):
            self._merge()
            if n > len(self._free):
                return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if len(slots):
            self._pending.append(slots.to(torch.int64))


class ReqToTokenPool:
    """`req_to_token[req_slot, position] -> kv slot`; one row per running request."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu"):
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int64, device=device)
        self._free = list(range(max_reqs))
        self.max_reqs = max_reqs

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        assert idx not in self._free, "req slot freed twice"
        self._free.append(idx)

    def clear(self) -> None:
        self._free = list(range(self.max_reqs))
