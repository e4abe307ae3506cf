"""Prompt-lookup drafts: guess a request's next tokens from where its last few tokens occurred before.

Greedy constrained requests repeat themselves (an array of objects repeats its keys, the model's
own odd split of a key, a run of digits), so what followed the last n-gram the previous time is
often what the model produces next. The guess costs no forward pass; the model checks it.
"""

from __future__ import annotations

import numpy as np

MAX_NGRAM = 3
MAX_HISTORY = 4096  # search only this many trailing tokens, so the cost per step is bounded


def lookup_drafts(seq: list[int], max_len: int, max_ngram: int = MAX_NGRAM) -> list[list[int]]:
    """Continuations of the last n tokens of `seq` (n = max_ngram down to 1) at their most recent
    earlier occurrence, up to `max_len` tokens each, longest n first; [] where an n-gram has none.
    A continuation that reaches the end of `seq` repeats with the period the match implies."""
    a = np.asarray(seq[-MAX_HISTORY:], dtype=np.int64)
    L = len(a)
    out = []
    if max_len <= 0:
        return out
    for n in range(max_ngram, 0, -1):
        if L <= n:
            continue
        hits = np.ones(L - n, dtype=bool)  # hits[i]: a[i:i+n] equals the last n tokens, i + n < L
        for j in range(n):
            hits &= a[j:L - n + j] == a[L - n + j]
        idx = np.flatnonzero(hits)
        if idx.size:
            i = int(idx[-1]) + n
            out.append(np.resize(a[i:], max_len).tolist())  # tiles a[i:] when it is short
    return out
