"""Byte DFA -> token-level index: which tokens each DFA state allows, as packed bitmasks.

The byte DFA (automaton.py) is what the matcher runs: tokens are byte strings, so a UTF-8
character split across two tokens is just a path through intermediate (mid-character) states.
"""

from __future__ import annotations

import numpy as np

from strand.constrained.automaton import _ranges, check_deadline
from strand.constrained.errors import GrammarCompileError
from strand.constrained.tokenizer_info import TokenizerInfo


def _trie_walk(T: np.ndarray, info: TokenizerInfo, origins: np.ndarray, deadline: float | None):
    """Walk the vocabulary trie from the given states at once, level by level.
    Returns (origin, token, next state) for every token whose bytes stay alive in T."""
    trie = info.trie
    out_o, out_t, out_n = [], [], []
    lvl1 = np.arange(trie.depth_start[1], trie.depth_start[2], dtype=np.int64)
    origin = np.repeat(origins.astype(np.int64), len(lvl1))
    node = np.tile(lvl1, len(origins))
    st = T[origin, trie.byte[node]]
    child_start, child_count, node_token, byte = trie.child_start, trie.child_count, trie.node_token, trie.byte
    while True:
        check_deadline(deadline)
        alive = np.flatnonzero(st >= 0)
        if not len(alive):
            break
        origin, node, st = origin[alive], node[alive], st[alive]
        tok = node_token[node]
        has = np.flatnonzero(tok >= 0)
        out_o.append(origin[has])
        out_t.append(tok[has])
        out_n.append(st[has])
        cnt = child_count[node]
        keep = np.flatnonzero(cnt)
        if not len(keep):
            break
        origin, node, st, cnt = origin[keep], node[keep], st[keep], cnt[keep]
        ends = np.cumsum(cnt)
        total = int(ends[-1])
        node = np.arange(total) + np.repeat(child_start[node] - (ends - cnt), cnt)
        origin = np.repeat(origin, cnt)
        st = T[np.repeat(st, cnt), byte[node]]
    origin = np.concatenate(out_o) if out_o else np.zeros(0, np.int64)
    tok = np.concatenate(out_t).astype(np.int64) if out_t else np.zeros(0, np.int64)
    nxt = np.concatenate(out_n) if out_n else np.zeros(0, np.int64)
    if len(trie.dup_node):  # tokens sharing bytes with another token follow it
        extra_o, extra_t, extra_n = [], [], []
        for n, dt in zip(trie.dup_node.tolist(), trie.dup_token.tolist()):
            sel = tok == int(trie.node_token[n])
            extra_o.append(origin[sel])
            extra_t.append(np.full(int(sel.sum()), dt, dtype=np.int64))
            extra_n.append(nxt[sel])
        origin = np.concatenate([origin] + extra_o)
        tok = np.concatenate([tok] + extra_t)
        nxt = np.concatenate([nxt] + extra_n)
    return origin, tok, nxt


def _pack(origin: np.ndarray, tok: np.ndarray, S: int, W: int, out: np.ndarray | None = None) -> np.ndarray:
    """OR the distinct (state, token) pairs into a packed uint32 [S, W] mask (into `out`)."""
    flat = np.bincount(origin * W + (tok >> 5), weights=(1 << (tok & 31)).astype(np.float64), minlength=S * W)
    packed = flat.astype(np.uint64).astype(np.uint32).reshape(S, W)
    if out is None:
        return packed
    out |= packed
    return out


def _add_eos(mask: np.ndarray, acc: np.ndarray, info: TokenizerInfo) -> np.ndarray:
    for e in info.eos_token_ids:
        if e < info.vocab_size:
            mask[acc, e >> 5] |= np.uint32(1 << (e & 31))
    return mask


def build_token_index_exact(T: np.ndarray, acc: np.ndarray, info: TokenizerInfo, deadline: float | None = None) -> np.ndarray:
    """The packed mask uint32 [S, W] by walking the trie from every state. A token is allowed in
    state s iff its bytes lead through T to a state from which the grammar can still finish
    using tokens (token-level dead ends are removed)."""
    S, W = T.shape[0], info.num_words
    origin, tok, nxt = _trie_walk(T, info, np.arange(S), deadline)
    # Token-level dead ends (states with no usable token that are not accepting): tokens leading
    # there are removed, repeatedly. With byte-level BPE every byte is a token, so this is rare.
    keep = np.ones(len(tok), dtype=bool)
    while True:
        has_tok = np.bincount(origin[keep], minlength=S) > 0
        stuck = ~has_tok & ~acc
        bad = keep & stuck[nxt]
        if not bad.any():
            break
        keep &= ~bad
    if stuck[0]:
        raise GrammarCompileError("the grammar accepts no string expressible with this tokenizer")
    return _add_eos(_pack(origin[keep], tok[keep], S, W), acc, info)


# --- chain states -------------------------------------------------------------------------------
# A state inside a string (or a run of digits, or a counted repetition) moves every character of
# a large class to one next state: itself for a loop, the next counter for maxLength. Walking
# the whole vocabulary trie from each such state is what makes an index slow; instead, each
# token is classified once per character class (cached per tokenizer): the leading characters in
# the class move along the chain in one step, and only tokens with other bytes are walked.

_MIN_CHAIN_LEN = 4  # characters a chain must take in one step to be worth it
_MAX_CHAIN_WALK = 4096  # tokens to walk past a chain above which the trie walk is used
_MIN_CHAIN_ASCII = 32  # ASCII bytes sharing one target that make a state a chain state


def _all_same(rows: np.ndarray) -> np.ndarray:
    """For each row: its value if all entries are equal and >= 0, else -2."""
    first = rows[:, 0]
    ok = (rows == first[:, None]).all(1) & (first >= 0)
    return np.where(ok, first, -2)


_CONT = slice(0x80, 0xC0)
# Lead bytes of valid UTF-8 characters: (leads, the range of the first continuation byte when
# narrower than 80-BF, continuation bytes after the lead).
_LEADS = (
    (list(range(0xC2, 0xE0)), None, 1),
    ([0xE0], slice(0xA0, 0xC0), 2),
    (list(range(0xE1, 0xED)) + [0xEE, 0xEF], None, 2),
    ([0xED], slice(0x80, 0xA0), 2),
    ([0xF0], slice(0x90, 0xC0), 3),
    ([0xF1, 0xF2, 0xF3], None, 3),
    ([0xF4], slice(0x80, 0x90), 3),
)


def _after_any_char(T: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """For states qs: the state every valid non-ASCII character leads to, or -2 if they differ
    or one dies."""
    S = T.shape[0]
    Tp = np.r_[T, np.full((1, T.shape[1]), -1, dtype=T.dtype)]  # row S: dead

    def through(nxt: np.ndarray, then: np.ndarray) -> np.ndarray:
        return _all_same(np.where(nxt >= 0, then[np.maximum(nxt, 0)], -2))

    after = [np.r_[np.arange(S), -2]]  # after[n][s]: where n more continuation bytes lead
    for _ in range(3):
        after.append(np.r_[through(T[:, _CONT], after[-1]), -2])
    res = []
    for leads, first, need in _LEADS:
        s1 = T[np.ix_(qs, leads)]  # [nq, nleads]
        s1 = np.where(s1 >= 0, s1, S)
        if first is None:
            res.append(after[need][s1])
        else:
            rows = Tp[s1[:, 0]][:, first]
            res.append(through(rows, after[need - 1])[:, None])
    return _all_same(np.concatenate(res, axis=1))


def _chain_states(T: np.ndarray):
    """(key id per state or -1, keys, next state per state). A chain state's key is the set of
    characters that all lead to its next state: bytes 0-127 plus 'every non-ASCII character'."""
    S = T.shape[0]
    asc = T[:, :128]
    key_id = np.full(S, -1, dtype=np.int64)
    nxt = np.full(S, -1, dtype=np.int64)
    n_live = (asc >= 0).sum(1)
    cand = np.nonzero((n_live >= _MIN_CHAIN_ASCII) | (T[:, 0xC3] >= 0))[0]
    if not len(cand):
        return key_id, [], nxt
    targets = np.empty(len(cand), dtype=np.int64)
    for i, q in enumerate(cand.tolist()):  # the most common live ASCII target
        row = asc[q][asc[q] >= 0]
        targets[i] = np.bincount(row).argmax() if len(row) else -1
    in_cls = asc[cand] == targets[:, None]
    uni = (_after_any_char(T, cand) == targets) & (targets >= 0)
    n_in = in_cls.sum(1)
    ok = (targets >= 0) & ((n_in >= _MIN_CHAIN_ASCII) | (uni & (n_in > 0)))
    cand, targets, in_cls, uni = cand[ok], targets[ok], in_cls[ok], uni[ok]
    if not len(cand):
        return key_id, [], nxt
    key_rows = np.concatenate([in_cls, uni[:, None]], axis=1).astype(np.uint8)
    keys: dict[bytes, int] = {}
    for q, row in zip(cand.tolist(), key_rows):
        key_id[q] = keys.setdefault(row.tobytes(), len(keys))
    nxt[cand] = targets
    return key_id, list(keys), nxt


def _walk(T: np.ndarray, tt, st: np.ndarray, tok: np.ndarray, off: np.ndarray) -> np.ndarray:
    """Walk tokens' remaining bytes (from byte `off`) from states `st`; -1 where they die."""
    st, off = st.copy(), off.copy()
    live = np.nonzero(off < tt.length[tok])[0]
    while len(live):
        st[live] = T[st[live], tt.bytes[tok[live], off[live]]]
        off[live] += 1
        live = live[(st[live] >= 0) & (off[live] < tt.length[tok[live]])]
    return st


def build_token_index(T: np.ndarray, acc: np.ndarray, info: TokenizerInfo, deadline: float | None = None) -> np.ndarray:
    """The packed mask uint32 [S, W], equal to build_token_index_exact: chain states by token
    classes, the other states by walking the trie."""
    S, W, V = T.shape[0], info.num_words, info.vocab_size
    tt = info.token_table
    key_id, keys, nxt = _chain_states(T)
    L = tt.max_chars
    chains: dict[int, list[int]] = {}  # states after 0, 1, ... characters of the class
    for q in np.nonzero(key_id >= 0)[0].tolist():
        chain = [q]
        while len(chain) <= L and key_id[chain[-1]] == key_id[q]:
            chain.append(int(nxt[chain[-1]]))
        if len(chain) - 1 >= _MIN_CHAIN_LEN:
            chains[q] = chain
        else:  # a short chain saves little: most tokens would be walked past its end anyway
            key_id[q] = -1
    mask = np.zeros((S, W), dtype=np.uint32)
    packed_pure: dict[tuple, np.ndarray] = {}  # (key, d) -> packed row of the tokens taken whole
    walk_q, walk_t, walk_st, walk_off = [], [], [], []
    parts_lead_o: list[np.ndarray] = []
    parts_lead_t: list[np.ndarray] = []
    for q, chain in chains.items():
        check_deadline(deadline)
        cls = tt.classify(keys[key_id[q]])
        d = len(chain) - 1  # characters the chain can take in one step
        chain_arr = np.asarray(chain, dtype=np.int64)
        # Tokens whose class run ends (c <= d) at a byte the chain state there lets through...
        g = np.nonzero(cls.group_c <= d)[0]
        g = g[T[chain_arr[cls.group_c[g]], cls.group_byte[g]] >= 0]
        walked = [cls.broken[_ranges(cls.group_start[g], cls.group_start[g + 1])]]
        # ... and tokens with more class characters than the chain takes: walk the rest.
        over = cls.by_c[np.searchsorted(cls.c_sorted, d, side="right"):]
        if len(over):  # (only those the end of the chain lets through)
            at = tt.char_end[over, d]
            over = over[T[chain[-1], tt.bytes[over, np.minimum(at, tt.bytes.shape[1] - 1)]] >= 0]
        walked.append(over)
        rest = np.concatenate(walked)
        if len(rest) > _MAX_CHAIN_WALK:  # most tokens get past the chain: the trie does better
            key_id[q] = -1
            continue
        kk = np.minimum(cls.c[rest], d)
        row = packed_pure.get((key_id[q], d))
        if row is None:
            bits = np.zeros(W * 32, dtype=bool)
            bits[:V] = cls.pure & (cls.c <= d)
            row = packed_pure[(key_id[q], d)] = np.packbits(bits, bitorder="little").view(np.uint32)
        mask[q] = row
        walk_q.append(np.full(len(rest), q, dtype=np.int64))
        walk_t.append(rest)
        walk_st.append(chain_arr[kk])
        walk_off.append(tt.char_end[rest, kk])
    # Lead-in states: every live byte is ASCII and leads into the same chain state (the opening
    # quote of a string, the letter after a backslash). Tokens that start with such a byte and
    # continue as whole class characters the chain takes are allowed as they are; the other
    # tokens that start with one are walked.
    other = np.nonzero(key_id == -1)[0]
    live = T[other] >= 0
    first_t = np.where(live, T[other], -1).max(1)
    single = (np.where(live, T[other], first_t[:, None]) == first_t[:, None]).all(1) & ~live[:, 0x80:].any(1)
    for q, q2 in zip(other[single & (first_t >= 0)].tolist(), first_t[single & (first_t >= 0)].tolist()):
        chain = chains.get(q2)
        if chain is None or key_id[q2] < 0:
            continue
        cls = tt.classify(keys[key_id[q2]])
        bs = np.nonzero(T[q] >= 0)[0]
        cand = tt.by_first[_ranges(tt.by_first_start[bs], tt.by_first_start[bs + 1])]
        ok = cls.pure1[cand] & (cls.c1[cand] <= len(chain) - 1)
        rest = cand[~ok]
        if len(rest) > _MAX_CHAIN_WALK:
            continue
        key_id[q] = -2  # handled here, not by the trie
        parts_lead_o.append(np.full(int(ok.sum()), q, dtype=np.int64))
        parts_lead_t.append(cand[ok])
        walk_q.append(np.full(len(rest), q, dtype=np.int64))
        walk_t.append(rest)
        walk_st.append(np.full(len(rest), q, dtype=np.int64))
        walk_off.append(np.zeros(len(rest), dtype=np.int64))
    o, t, _ = _trie_walk(T, info, np.nonzero(key_id == -1)[0], deadline)
    parts_o, parts_t = [o] + parts_lead_o, [t] + parts_lead_t
    if walk_q:
        q_all, t_all = np.concatenate(walk_q), np.concatenate(walk_t)
        st = _walk(T, tt, np.concatenate(walk_st), t_all, np.concatenate(walk_off))
        ok = st >= 0
        parts_o.append(q_all[ok])
        parts_t.append(t_all[ok])
    origin, tok = np.concatenate(parts_o), np.concatenate(parts_t)
    _pack(origin, tok.astype(np.int64), S, W, out=mask)
    # A state with no token that is not accepting would need the exact, iterative pruning.
    has_tok = mask.any(1)
    if (~has_tok & ~acc).any():
        return build_token_index_exact(T, acc, info, deadline)
    return _add_eos(mask, acc, info)
