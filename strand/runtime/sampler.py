"""Sampling for a whole batch at once: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Every operation is a tensor op over the rows that need it; the only per-row Python work is drawing
the uniform noise of a request that has its own seed (so its text does not depend on its batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strand.runtime.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs to know about one request at one step."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None  # per-request RNG when a seed was given
    stop_ids: list[int]  # EOS + stop_token_ids; masked while under min_new_tokens
    top_logprobs_num: int = 0
    want_logprob: bool = False


@dataclass
class SampleResult:
    next_ids: list[int]
    logprobs: list[float] | None  # chosen token's logprob per row (None where not asked)
    top_logprobs: list[list[tuple[float, int]]] | None


def _pad(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(x) for x in lists), default=0) or 1
    ids = torch.zeros(len(lists), width, dtype=torch.int64)
    valid = torch.zeros(len(lists), width, dtype=torch.bool)
    for i, x in enumerate(lists):
        if x:
            ids[i, :len(x)] = torch.tensor(x, dtype=torch.int64)
            valid[i, :len(x)] = True
    return ids, valid


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Frequency/presence (over output tokens, as OpenAI) and repetition (over prompt+output, as HF)."""
    B, V = logits.shape
    pen = [i for i, r in enumerate(rows)
           if r.params.frequency_penalty or r.params.presence_penalty]
    if pen:
        ids, valid = _pad([rows[i].output_ids for i in pen])
        counts = torch.zeros(len(pen), V, dtype=logits.dtype).scatter_add_(1, ids, valid.to(logits.dtype))
        freq = torch.tensor([rows[i].params.frequency_penalty for i in pen], dtype=logits.dtype)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in pen], dtype=logits.dtype)[:, None]
        idx = torch.tensor(pen)
        logits[idx] -= freq * counts + pres * (counts > 0).to(logits.dtype)
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        ids, valid = _pad([rows[i].prompt_ids + rows[i].output_ids for i in rep])
        seen = torch.zeros(len(rep), V, dtype=torch.bool).scatter_(1, ids, valid)
        rp = torch.tensor([rows[i].params.repetition_penalty for i in rep], dtype=logits.dtype)[:, None]
        idx = torch.tensor(rep)
        sub = logits[idx]
        penalized = torch.where(sub > 0, sub / rp, sub * rp)
        logits[idx] = torch.where(seen, penalized, sub)


def mask_stop_tokens_under_min(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    for i, r in enumerate(rows):  # rare: only rows with min_new_tokens not yet reached
        if r.params.min_new_tokens and len(r.output_ids) < r.params.min_new_tokens and r.stop_ids:
            logits[i, r.stop_ids] = float("-inf")


def top_logprobs_of(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    vals, ids = logprobs.topk(k, dim=-1)
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())]


def sample(logits: torch.Tensor, rows: list[SampleRow], default_generator: torch.Generator) -> SampleResult:
    """Pick one token per row of `logits` [B, V] (float32; modified in place)."""
    B = logits.shape[0]
    want_lp = [r.want_logprob for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None

    apply_penalties(logits, rows)
    mask_stop_tokens_under_min(logits, rows)

    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
    greedy = (temps == 0) | torch.tensor([r.params.top_k == 1 for r in rows])
    next_ids = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        rows_s = (~greedy).nonzero().squeeze(1)
        sub = logits[rows_s] / temps[rows_s, None]  # [S, V]
        probs = torch.softmax(sub, dim=-1)
        params = [rows[i].params for i in rows_s.tolist()]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[1] for p in params])
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
        if bool((top_k < probs.shape[1]).any() | (top_p < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(probs.shape[1]).unsqueeze(0)
            # keep a token if it is within top-k and the mass before it is below top-p
            drop = (rank >= top_k[:, None]) | ((sorted_p.cumsum(-1) - sorted_p) > top_p[:, None])
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p exactly.
        noise = torch.empty_like(probs).exponential_(generator=default_generator)
        for j, i in enumerate(rows_s.tolist()):
            if rows[i].generator is not None:  # a seeded request draws from its own stream
                noise[j].exponential_(generator=rows[i].generator)
        next_ids[rows_s] = (probs / noise).argmax(dim=-1)

    ids = next_ids.tolist()
    logprobs = top = None
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, next_ids[:, None]).squeeze(1).tolist()
        logprobs = [chosen[i] if want_lp[i] else None for i in range(B)]
        k = max(r.top_logprobs_num for r in rows)
        if k:
            all_top = top_logprobs_of(raw_logprobs, k)
            top = [all_top[i][: rows[i].top_logprobs_num] if want_lp[i] else [] for i in range(B)]
    return SampleResult(ids, logprobs, top)
