"""What one forward pass computes: a mix of extend requests and decode requests, flattened."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Tokens of all requests laid end to end, extends first, then decodes.

    Request i contributes `extend_lens[i]` new tokens (1 for a decode) at positions
    `prefix_lens[i] .. seq_lens[i] - 1`; its KV for every position lives at
    `req_to_token[req_pool_indices[i], :seq_lens[i]]` once this pass has stored the new ones.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    req_pool_indices: list[int]  # [B]
    prefix_lens: list[int]  # [B] tokens already in the KV pool before this pass
    extend_lens: list[int]  # [B] new tokens this pass
    num_extends: int  # the first `num_extends` requests are extends, the rest single-token decodes
    logits_indices: torch.Tensor  # [L] rows of the flattened tokens whose logits are wanted
    req_to_token: torch.Tensor  # [max_reqs, max_context] the table (shared, not copied)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
