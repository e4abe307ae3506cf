"""Regex -> character FSM (interegular) -> byte DFA -> token-level index.

The byte DFA is what the matcher runs: tokens are byte strings, so a UTF-8 character split across
two tokens is just a path through intermediate (mid-character) states, and no token can leave the
DFA in the middle of an invalid UTF-8 sequence.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import numpy as np

from strand.constrained.errors import GrammarCompileError
from strand.constrained.tokenizer_info import TokenizerInfo

DEAD = -1


def check_deadline(deadline: float | None, what: str = "compile") -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise GrammarCompileError(f"grammar {what} timed out")


# --- regex -> interegular FSM ---------------------------------------------------------------

# Python's \D, \W, \S match non-ASCII digits/word/space chars differently from interegular's
# ASCII sets; outside a class we narrow them to ASCII so every output also matches `re`.
_ASCII_NEG = {
    "D": r"[\x00-\x2f\x3a-\x7f]",
    "W": r"[\x00-\x2f\x3a-\x40\x5b-\x5e\x60\x7b-\x7f]",
    "S": r"[\x00-\x08\x0e-\x1f\x21-\x7f]",
}


def literal_char(c: str) -> str:
    """A regex (inside or outside a class) matching exactly the char c, in interegular's syntax."""
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return "\\x%02x" % ord(c)
    if c in "\\.^$|?*+()[]{}-/#&~ \"'!,:;<=>@%`":
        return "\\" + c
    return c


def strip_anchors(regex: str) -> str:
    """Drop a leading ^ and a trailing unescaped $ (matching is always anchored), unless the
    regex has a top-level alternation, where they would bind to one branch only."""
    if not (regex.startswith("^") or _ends_with_dollar(regex)):
        return regex
    if _has_top_level_bar(regex):
        raise GrammarCompileError("regex: ^/$ anchors with a top-level '|' are not supported; group the alternation")
    if regex.startswith("^"):
        regex = regex[1:]
    if _ends_with_dollar(regex):
        regex = regex[:-1]
    return regex


def _ends_with_dollar(regex: str) -> bool:
    if not regex.endswith("$"):
        return False
    n = len(regex) - 1
    bs = 0
    while n - 1 - bs >= 0 and regex[n - 1 - bs] == "\\":
        bs += 1
    return bs % 2 == 0


def _has_top_level_bar(regex: str) -> bool:
    depth, in_class, i = 0, False, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
        elif c == "[":
            in_class = True
            if regex[i + 1 : i + 2] == "]" or regex[i + 1 : i + 3] == "^]":
                i += 2 if regex[i + 1] == "]" else 3
                continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            return True
        i += 1
    return False


def _normalize_regex(regex: str) -> str:
    out = []
    i, in_class = 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt in _ASCII_NEG:
                if in_class:
                    raise GrammarCompileError(f"regex: \\{nxt} inside a character class is not supported")
                out.append(_ASCII_NEG[nxt])
            elif nxt in "uU":
                width = 4 if nxt == "u" else 8
                hexd = regex[i + 2 : i + 2 + width]
                if len(hexd) != width or any(h not in "0123456789abcdefABCDEF" for h in hexd):
                    raise GrammarCompileError(f"regex: bad \\{nxt} escape")
                out.append(literal_char(chr(int(hexd, 16))))
                i += 2 + width
                continue
            elif nxt in "bBAZ":
                raise GrammarCompileError(f"regex: \\{nxt} (anchor/boundary) is not supported")
            else:
                out.append(regex[i : i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            # a ']' right after '[' or '[^' is literal
            j = i + 1
            if j < len(regex) and regex[j] == "^":
                out.append("^")
                j += 1
            if j < len(regex) and regex[j] == "]":
                out.append("\\]")
                j += 1
            i = j
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def regex_to_char_fsm(regex: str):
    import interegular

    try:
        re.compile(regex)
    except re.error as e:
        raise GrammarCompileError(f"regex: invalid pattern {regex!r}: {e}") from None
    try:
        return interegular.parse_pattern(_normalize_regex(strip_anchors(regex))).to_fsm()
    except GrammarCompileError:
        raise
    except Exception as e:  # interegular raises Unsupported / InvalidSyntax / others
        raise GrammarCompileError(f"regex: unsupported construct in {regex!r}: {type(e).__name__}: {e}") from None


# --- char FSM -> byte DFA -------------------------------------------------------------------


def _utf8_cont_range(prefix: bytes) -> range:
    """Valid next bytes after an incomplete UTF-8 prefix (lead byte plus continuations)."""
    if len(prefix) == 1:
        lead = prefix[0]
        if lead == 0xE0:
            return range(0xA0, 0xC0)
        if lead == 0xED:
            return range(0x80, 0xA0)
        if lead == 0xF0:
            return range(0x90, 0xC0)
        if lead == 0xF4:
            return range(0x80, 0x90)
    return range(0x80, 0xC0)


def _utf8_len(lead: int) -> int:
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0  # invalid lead byte


class _ByteBuilder:
    def __init__(self):
        self.rows: list[list[int]] = []
        self.accepting: list[bool] = []
        self._generic: dict[tuple, int] = {}

    def new_state(self, accepting: bool = False) -> int:
        self.rows.append([DEAD] * 256)
        self.accepting.append(accepting)
        return len(self.rows) - 1

    def generic(self, target: int, prefix: bytes) -> int:
        """State after `prefix` of a char when any valid completion goes to `target`."""
        if target == DEAD:
            return DEAD
        need = _utf8_len(prefix[0]) - len(prefix)
        special = prefix[0] if len(prefix) == 1 and prefix[0] in (0xE0, 0xED, 0xF0, 0xF4) else None
        key = (target, need, special)
        if key in self._generic:
            return self._generic[key]
        s = self.new_state()
        self._generic[key] = s
        nxt = target if need == 1 else self.generic(target, prefix + b"\x80")
        for b in _utf8_cont_range(prefix):
            self.rows[s][b] = nxt
        return s


def char_fsm_to_byte_dfa(fsm, deadline: float | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Returns (T int32 [S, 256] with -1 for dead, accepting bool [S], initial state)."""
    from interegular.fsm import anything_else

    alpha = fsm.alphabet
    states = sorted(fsm.states, key=repr)
    sid = {s: i for i, s in enumerate(states)}
    b = _ByteBuilder()
    for s in states:
        b.new_state(s in fsm.finals)
    explicit = [c for c in alpha if c is not anything_else]
    else_key = alpha[anything_else] if anything_else in alpha else None
    for s in states:
        check_deadline(deadline)
        row_map = fsm.map.get(s, {})
        si = sid[s]

        def tgt_of_key(k):
            t = row_map.get(k) if k is not None else None
            return DEAD if t is None else sid[t]

        d = tgt_of_key(else_key)
        overrides: dict[bytes, int] = {}
        row = b.rows[si]
        for c in explicit:
            t = tgt_of_key(alpha[c])
            if ord(c) < 0x80:
                row[ord(c)] = t
            elif t != d:
                overrides[c.encode("utf-8")] = t
        for byte in range(0x80):
            if chr(byte) not in alpha:
                row[byte] = d
        # Non-ASCII: generic UTF-8 paths to the default target, with a trie for chars that differ.
        prefixes = {ob[:n] for ob in overrides for n in range(1, len(ob))}
        trie_state = {p: b.new_state() for p in sorted(prefixes)}

        def fill(state: int, prefix: bytes, allowed):
            for nb in allowed:
                p = prefix + bytes([nb])
                if p in overrides:
                    b.rows[state][nb] = overrides[p]
                elif p in trie_state:
                    b.rows[state][nb] = trie_state[p]
                elif len(p) == _utf8_len(p[0]):
                    b.rows[state][nb] = d
                else:
                    b.rows[state][nb] = b.generic(d, p)

        fill(si, b"", [x for x in range(0x80, 0x100) if _utf8_len(x)])
        for p, st in trie_state.items():
            fill(st, p, _utf8_cont_range(p))
    T = np.asarray(b.rows, dtype=np.int32).reshape(-1, 256)
    acc = np.asarray(b.accepting, dtype=bool)
    return T, acc, sid[fsm.initial]


def prune_and_minimize(T: np.ndarray, acc: np.ndarray, init: int) -> tuple[np.ndarray, np.ndarray]:
    """Drop states that are unreachable or cannot reach an accepting state; merge equivalent
    states (Moore refinement, vectorized). Returns (T, acc) with the initial state renumbered 0.
    Raises GrammarCompileError if the language is empty."""
    S = T.shape[0]
    # forward reachability
    reach = np.zeros(S, dtype=bool)
    reach[init] = True
    frontier = np.array([init])
    while len(frontier):
        nxt = np.unique(T[frontier])
        nxt = nxt[nxt >= 0]
        nxt = nxt[~reach[nxt]]
        reach[nxt] = True
        frontier = nxt
    # backward: live = can reach accepting
    live = acc & reach
    src, byt = np.nonzero(T >= 0)
    dst = T[src, byt]
    keep = reach[src]
    src, dst = src[keep], dst[keep]
    order = np.argsort(dst, kind="stable")
    src_sorted, dst_sorted = src[order], dst[order]
    starts = np.searchsorted(dst_sorted, np.arange(S + 1))
    frontier = np.nonzero(live)[0]
    while len(frontier):
        preds = np.concatenate([src_sorted[starts[f] : starts[f + 1]] for f in frontier]) if len(frontier) else np.array([], int)
        preds = np.unique(preds)
        preds = preds[~live[preds]]
        live[preds] = True
        frontier = preds
    if not live[init]:
        raise GrammarCompileError("the grammar accepts no string")
    ids = np.nonzero(live)[0]
    # initial first
    ids = np.r_[init, ids[ids != init]]
    remap = np.full(S + 1, DEAD, dtype=np.int32)  # index S is for DEAD (-1)
    remap[ids] = np.arange(len(ids), dtype=np.int32)
    T2 = T[ids]
    T2 = remap[np.where(T2 >= 0, T2, S)]
    acc2 = acc[ids]
    # Moore minimization: refine classes until stable.
    cls = acc2.astype(np.int64)
    n_cls = len(np.unique(cls))
    # Only the bytes where some state differs from the others matter for the signature.
    cols = np.nonzero((T2 != T2[:1]).any(0) | (T2[0] >= 0))[0]
    Tc = T2[:, cols]
    while True:
        nxt_cls = np.where(Tc >= 0, cls[np.maximum(Tc, 0)], -1)
        sig = np.concatenate([cls[:, None], nxt_cls], axis=1)
        # group equal rows: lexsort then compare neighbours (faster than unique(axis=0))
        order = np.lexsort(sig.T[::-1])
        srt = sig[order]
        new_group = np.r_[True, (srt[1:] != srt[:-1]).any(1)]
        gid = np.cumsum(new_group) - 1
        new_cls = np.empty(len(cls), dtype=np.int64)
        new_cls[order] = gid
        n_new = int(gid[-1]) + 1
        cls = new_cls
        if n_new == n_cls:
            break
        n_cls = n_new
    # renumber classes so the initial state's class is 0, in first-seen order
    _, first = np.unique(cls, return_index=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    cls = rank[cls]
    reps = np.sort(first)
    T3 = T2[reps]
    T3 = np.where(T3 >= 0, cls[np.maximum(T3, 0)], DEAD).astype(np.int32)
    return np.ascontiguousarray(T3), acc2[reps].copy()


# --- token index ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenIndex:
    mask: np.ndarray  # uint32 [S, W] allowed tokens per state (EOS included in accepting states)


def build_token_index(T: np.ndarray, acc: np.ndarray, info: TokenizerInfo, deadline: float | None = None) -> np.ndarray:
    """Walk the vocabulary trie from every state at once, level by level.

    Returns the packed mask uint32 [S, W]. A token is allowed in state s iff its bytes lead
    through T to a state from which the grammar can still finish using tokens."""
    trie = info.trie
    S, W = T.shape[0], info.num_words
    origins, toks, nexts = [], [], []
    lvl1 = np.arange(trie.depth_start[1], trie.depth_start[2], dtype=np.int64)
    origin = np.repeat(np.arange(S, dtype=np.int64), len(lvl1))
    node = np.tile(lvl1, S)
    st = T[origin, trie.byte[node]]
    while True:
        check_deadline(deadline)
        alive = st >= 0
        origin, node, st = origin[alive], node[alive], st[alive]
        if not len(node):
            break
        tok = trie.node_token[node]
        has = tok >= 0
        origins.append(origin[has])
        toks.append(tok[has])
        nexts.append(st[has])
        # expand to children
        cnt = trie.child_count[node]
        total = int(cnt.sum())
        if total == 0:
            break
        rep = np.repeat(np.arange(len(node)), cnt)
        offs = np.cumsum(cnt) - cnt
        child = trie.child_start[node][rep] + (np.arange(total) - offs[rep])
        origin = origin[rep]
        st = T[st[rep], trie.byte[child]]
        node = child
    origin = np.concatenate(origins) if origins else np.zeros(0, np.int64)
    tok = np.concatenate(toks).astype(np.int64) if toks else np.zeros(0, np.int64)
    nxt = np.concatenate(nexts) if nexts else np.zeros(0, np.int64)
    if len(trie.dup_node):  # tokens sharing bytes with another token follow it
        node_of_tok = np.full(info.vocab_size, -1, dtype=np.int64)
        valid = trie.node_token >= 0
        node_of_tok[trie.node_token[valid]] = np.nonzero(valid)[0]
        dup_of = {int(t): int(trie.node_token[n]) for n, t in zip(trie.dup_node, trie.dup_token)}
        extra_o, extra_t, extra_n = [], [], []
        for dt, base in dup_of.items():
            sel = tok == base
            extra_o.append(origin[sel])
            extra_t.append(np.full(int(sel.sum()), dt, dtype=np.int64))
            extra_n.append(nxt[sel])
        origin = np.concatenate([origin] + extra_o)
        tok = np.concatenate([tok] + extra_t)
        nxt = np.concatenate([nxt] + extra_n)
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
    origin, tok = origin[keep], tok[keep]
    flat = np.bincount(
        origin * W + (tok >> 5), weights=(1 << (tok & 31)).astype(np.float64), minlength=S * W
    )
    mask = flat.astype(np.uint64).astype(np.uint32).reshape(S, W)
    for e in info.eos_token_ids:
        if e < info.vocab_size:
            mask[acc, e >> 5] |= np.uint32(1 << (e & 31))
    return mask
