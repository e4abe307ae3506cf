"""Regex nodes -> byte-level NFA -> DFA (subset construction over byte classes) -> minimal DFA.

Characters become their UTF-8 byte sequences while the NFA is built, so the DFA reads bytes and
accepts only valid UTF-8: a token that ends in the middle of a character leaves the DFA in an
intermediate state, and no token can leave it in the middle of an invalid sequence.

Sets of NFA states are Python ints used as bitsets (over the NFA states that read a byte, plus
the final state), which makes the subset construction a few dict look-ups per DFA state.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from strand.constrained.errors import GrammarCompileError

DEAD = -1
MAX_DFA_STATES = 20_000  # a mask row is vocab/8 bytes: 20k states of a 50k vocabulary is 120 MB


def check_deadline(deadline: float | None, what: str = "compile") -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise GrammarCompileError(f"grammar {what} timed out")


@dataclass(frozen=True, eq=False)
class Dfa:
    """A DFA over bytes, stored over byte classes. State 0 is the start; every state is live
    (reachable, and able to reach an accepting state) once built by `compile_node`."""

    table: np.ndarray  # int32 [S, K], -1 = dead
    classes: np.ndarray  # int64 [256]: byte -> class
    accepting: np.ndarray  # bool [S]

    @property
    def num_states(self) -> int:
        return self.table.shape[0]

    def byte_table(self) -> np.ndarray:
        return np.ascontiguousarray(self.table[:, self.classes])


# --- UTF-8 -------------------------------------------------------------------------------------


def _utf8_split(lo: int, hi: int, out: list) -> None:
    """Append byte-range sequences covering code points lo..hi (no surrogates inside)."""
    if lo > hi:
        return
    for b in (0x7F, 0x7FF, 0xFFFF):
        if lo <= b < hi:
            _utf8_split(lo, b, out)
            _utf8_split(b + 1, hi, out)
            return
    if hi <= 0x7F:
        out.append(((lo, hi),))
        return
    for i in (1, 2, 3):
        m = (1 << (6 * i)) - 1
        if (lo & ~m) != (hi & ~m):
            if lo & m:
                _utf8_split(lo, lo | m, out)
                _utf8_split((lo | m) + 1, hi, out)
                return
            if (hi & m) != m:
                _utf8_split(lo, (hi & ~m) - 1, out)
                _utf8_split(hi & ~m, hi, out)
                return
    a, b = chr(lo).encode("utf-8"), chr(hi).encode("utf-8")
    out.append(tuple(zip(a, b)))


@functools.lru_cache(maxsize=4096)
def utf8_sequences(ivs: tuple) -> tuple:
    out: list = []
    for lo, hi in ivs:
        _utf8_split(lo, hi, out)
    return tuple(out)


# --- NFA ----------------------------------------------------------------------------------------


class _Nfa:
    def __init__(self, deadline: float | None):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []
        self.deadline = deadline
        self.shared: dict[tuple, int] = {}  # (canonical node id, end state) -> start state
        self._canon_by_obj: dict[int, int] = {}  # id(node) -> canonical id (nodes outlive the build)
        self._canon_by_key: dict[tuple, int] = {}
        self.lit_tails: dict[tuple, int] = {}  # (bytes, end state) -> start state

    def canon(self, node) -> int:
        """Equal nodes get equal ids (hash-consing over the node DAG, once per object)."""
        c = self._canon_by_obj.get(id(node))
        if c is not None:
            return c
        kind = node[0]
        if kind in ("s", "a"):
            key = (kind, tuple(self.canon(x) for x in node[1]))
        elif kind == "r":
            key = ("r", self.canon(node[1]), node[2], node[3])
        elif kind == "d":
            key = ("d", id(node[1]))
        else:
            key = node
        c = self._canon_by_key.setdefault(key, len(self._canon_by_key))
        self._canon_by_obj[id(node)] = c
        return c

    def _literal_tail(self, rest: bytes, e: int) -> int:
        """The state from which exactly `rest` leads to e (shared by literals ending alike)."""
        if not rest:
            return e
        key = (rest, e)
        n = self.lit_tails.get(key)
        if n is None:
            n = self.lit_tails[key] = self.new()
            self.edges[n].append((rest[0], rest[0], self._literal_tail(rest[1:], e)))
        return n

    def new(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def add(self, node, s: int, e: int) -> None:
        """Wire `node` from state s to state e."""
        kind = node[0]
        if kind == "l":
            data = node[1]
            self.edges[s].append((data[0], data[0], self._literal_tail(data[1:], e)))
        elif kind == "c":
            # Sequences share their tails (all UTF-8 sequences end in 80-BF runs), so a character
            # class adds one state per distinct tail instead of one per sequence.
            tails: dict = {(): e}

            def tail(rest: tuple) -> int:
                n = tails.get(rest)
                if n is None:
                    n = tails[rest] = self.new()
                    self.edges[n].append((rest[0][0], rest[0][1], tail(rest[1:])))
                return n

            for sq in utf8_sequences(node[1]):
                self.edges[s].append((sq[0][0], sq[0][1], tail(sq[1:])))
        elif kind == "s":
            # Built from the end, sharing the states of a suffix of items already wired to the
            # same end (the same node objects: alternatives that end alike, like the optional
            # members after a property), so the DFA has one copy of a shared tail.
            items = node[1]
            if not items:
                self.eps[s].append(e)
                return
            cur = e
            for item in reversed(items[1:]):
                key = (self.canon(item), cur)
                n = self.shared.get(key)
                if n is None:
                    n = self.shared[key] = self.new()
                    self.add(item, n, cur)
                cur = n
            self.add(items[0], s, cur)
        elif kind == "a":
            for item in node[1]:  # branches share s and e: loops never pass through either
                self.add(item, s, e)
        elif kind == "r":
            _, sub, lo, hi = node
            if len(self.eps) > 4 * MAX_DFA_STATES:
                raise GrammarCompileError("grammar too large (NFA states)")
            cur = s
            for _ in range(lo):
                n = self.new()
                self.add(sub, cur, n)
                cur = n
            if hi is None:
                loop, back = self.new(), self.new()
                self.eps[cur].append(loop)
                self.add(sub, loop, back)
                self.eps[back].append(loop)
                self.eps[loop].append(e)
            else:
                for _ in range(hi - lo):  # each optional copy may skip to the end
                    self.eps[cur].append(e)
                    n = self.new()
                    self.add(sub, cur, n)
                    cur = n
                self.eps[cur].append(e)
            check_deadline(self.deadline)
        elif kind == "d":
            self._embed(node[1], s, e)
        else:
            raise GrammarCompileError(f"regex: anchor {kind!r} is not supported here")

    def _embed(self, dfa: Dfa, s: int, e: int) -> None:
        T = dfa.byte_table()
        base = len(self.eps)
        for _ in range(T.shape[0]):
            self.new()
        self.eps[s].append(base)
        for q in np.nonzero(dfa.accepting)[0]:
            self.eps[base + int(q)].append(e)
        # runs of equal targets along each row become byte ranges
        change = np.ones_like(T, dtype=bool)
        change[:, 1:] = T[:, 1:] != T[:, :-1]
        rows, starts = np.nonzero(change)
        ends = np.r_[starts[1:], 256]
        ends = np.where(np.r_[rows[1:] != rows[:-1], True], 256, ends)
        tgts = T[rows, starts]
        for q, a, b, t in zip(rows.tolist(), starts.tolist(), ends.tolist(), tgts.tolist()):
            if t >= 0:
                self.edges[base + q].append((a, b - 1, base + t))


def _check_growth(num_states: int, deadline: float | None) -> None:
    """Called every few hundred states while a DFA is built: the deadline and the size limit."""
    check_deadline(deadline)
    if num_states > MAX_DFA_STATES:
        raise GrammarCompileError(f"grammar too large (over {MAX_DFA_STATES} DFA states)")


# --- subset construction --------------------------------------------------------------------------


def _determinize(nfa: _Nfa, start: int, final: int, deadline: float | None):
    bounds = {0, 256}
    for row in nfa.edges:
        for lo, hi, _ in row:
            bounds.add(lo)
            bounds.add(hi + 1)
    bounds = sorted(bounds)
    classes = np.zeros(256, dtype=np.int64)
    for k in range(len(bounds) - 1):
        classes[bounds[k] : bounds[k + 1]] = k
    K = len(bounds) - 1
    cls_of = classes.tolist()

    important = [n for n in range(len(nfa.eps)) if nfa.edges[n] or n == final]
    bit_of = {n: 1 << k for k, n in enumerate(important)}
    final_bit = bit_of[final]
    eps = nfa.eps
    closure_memo: dict[int, int] = {}

    def closure(n: int) -> int:
        bits = closure_memo.get(n)
        if bits is not None:
            return bits
        bits, seen, stack = 0, {n}, [n]
        while stack:
            x = stack.pop()
            bits |= bit_of.get(x, 0)
            for y in eps[x]:
                if y not in seen:
                    seen.add(y)
                    stack.append(y)
        closure_memo[n] = bits
        return bits

    rows_memo: dict[int, list] = {}

    def row_of(k: int) -> list:  # sparse [(class, closure bits)] of important state number k
        r = rows_memo.get(k)
        if r is None:
            edges = nfa.edges[important[k]]
            if len(edges) == 1 and cls_of[edges[0][0]] == cls_of[edges[0][1]]:  # one byte class
                r = rows_memo[k] = [(cls_of[edges[0][0]], closure(edges[0][2]))]
                return r
            dense: dict[int, int] = {}
            for lo, hi, t in edges:
                cb = closure(t)
                for c in range(cls_of[lo], cls_of[hi] + 1):
                    dense[c] = dense.get(c, 0) | cb
            r = rows_memo[k] = list(dense.items())
        return r

    start_bits = closure(start)
    ids = {start_bits: 0}
    order = [start_bits]
    table: list[list[int]] = []
    dead_row = [DEAD] * K
    i = 0
    while i < len(order):
        if i % 256 == 0:
            _check_growth(len(order), deadline)
        bits = order[i]
        i += 1
        low = bits & -bits
        if low == bits:  # one NFA state: its sparse row as is
            row = row_of(low.bit_length() - 1)
        else:
            merged: dict[int, int] = {}
            x = bits
            while x:
                low = x & -x
                x ^= low
                for c, v in row_of(low.bit_length() - 1):
                    merged[c] = merged.get(c, 0) | v
            row = merged.items()
        out = dead_row.copy()
        for c, v in row:
            j = ids.get(v)
            if j is None:
                j = ids[v] = len(order)
                order.append(v)
            out[c] = j
        table.append(out)
    T = np.asarray(table, dtype=np.int32).reshape(len(order), K)
    acc = np.fromiter(((b & final_bit) != 0 for b in order), dtype=bool, count=len(order))
    return T, acc, classes


# --- pruning and minimization ------------------------------------------------------------------


def _graph_search(stack: list, mark: np.ndarray, adj: list, starts: list) -> None:
    """Marks everything reachable from `stack` in the CSR graph (adj[starts[v]:starts[v+1]])."""
    seen = set(stack)
    for v in stack:
        mark[v] = True
    while stack:
        v = stack.pop()
        for w in adj[starts[v] : starts[v + 1]]:
            if w not in seen:
                seen.add(w)
                mark[w] = True
                stack.append(w)


_HASH_WEIGHTS = np.random.default_rng(0x5EED).integers(1, 2**63, size=4096, dtype=np.uint64) | np.uint64(1)


def _moore(T: np.ndarray, acc: np.ndarray, deadline: float | None = None) -> np.ndarray:
    """The coarsest partition of the states that refines acceptance and is a congruence
    (Moore refinement). Signatures are compared by a 64-bit hash; the result is checked to be a
    congruence, which makes the quotient correct whatever the hash did, and a failed check
    (a collision) redoes the refinement comparing signatures exactly."""
    safe, dead = np.maximum(T, 0), T < 0
    K = T.shape[1]
    live_cols = np.concatenate([acc[:, None], ~dead], axis=1)
    _, cls = _unique_rows(np.packbits(live_cols, axis=1))
    for exact in (False, True):
        n_cls = int(cls.max()) + 1
        while True:
            check_deadline(deadline)
            nxt = cls[safe]
            nxt[dead] = -1
            if exact:
                _, new_cls = _unique_rows(np.concatenate([cls[:, None], nxt], axis=1))
            elif K + 1 <= len(_HASH_WEIGHTS):
                h = nxt.astype(np.uint64) @ _HASH_WEIGHTS[1 : K + 1] + cls.astype(np.uint64) * _HASH_WEIGHTS[0]
                _, new_cls = np.unique(h, return_inverse=True)
            else:
                break
            new_cls = new_cls.reshape(-1)
            n_new = int(new_cls.max()) + 1
            cls = new_cls
            if n_new == n_cls:
                break
            n_cls = n_new
        _, first = np.unique(cls, return_index=True)
        rep = first[cls]
        nxt = cls[safe]
        nxt[dead] = -1
        if (nxt == nxt[rep]).all() and (acc == acc[rep]).all():
            return cls
    raise AssertionError("Moore refinement did not reach a congruence")


def prune_and_minimize(T: np.ndarray, acc: np.ndarray, init: int = 0, reachable_known: bool = False,
                       deadline: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Drop states that are unreachable or cannot reach an accepting state; merge equivalent
    states (Moore refinement, vectorized). Works on any column alphabet (bytes or classes).
    Returns (T, acc) with the initial state renumbered 0; raises if the language is empty."""
    S = T.shape[0]
    src, col = np.nonzero(T >= 0)
    dst = T[src, col]
    if reachable_known:
        reach = np.ones(S, dtype=bool)
    else:
        reach = np.zeros(S, dtype=bool)
        succ_starts = np.searchsorted(src, np.arange(S + 1))
        _graph_search([init], reach, dst.tolist(), succ_starts.tolist())
    keep = reach[src]
    src, dst = src[keep], dst[keep]
    order = np.argsort(dst, kind="stable")
    pred_starts = np.searchsorted(dst[order], np.arange(S + 1))
    live = acc & reach
    _graph_search(np.nonzero(live)[0].tolist(), live, src[order].tolist(), pred_starts.tolist())
    if not live[init]:
        raise GrammarCompileError("the grammar accepts no string")
    ids = np.nonzero(live)[0]
    ids = np.r_[init, ids[ids != init]]
    remap = np.full(S + 1, DEAD, dtype=np.int32)  # index S stands for DEAD (-1)
    remap[ids] = np.arange(len(ids), dtype=np.int32)
    T2 = remap[np.where(T[ids] >= 0, T[ids], S)]
    acc2 = acc[ids]
    cls = _moore(T2, acc2, deadline)
    n_cls = int(cls.max()) + 1
    if n_cls == len(cls):
        return np.ascontiguousarray(T2), acc2
    _, first = np.unique(cls, return_index=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    cls = rank[cls]
    reps = np.sort(first)
    T3 = T2[reps]
    T3 = np.where(T3 >= 0, cls[np.maximum(T3, 0)], DEAD).astype(np.int32)
    return np.ascontiguousarray(T3), acc2[reps].copy()


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], ends[i]) for all i, vectorized."""
    lens = ends - starts
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.repeat(starts - np.cumsum(lens) + lens, lens)
    return offs + np.arange(total)


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first row of each distinct row, row -> distinct-row id), rows compared as
    raw bytes (much faster than np.unique(axis=0))."""
    a = np.ascontiguousarray(a)
    v = a.view(np.dtype((np.void, a.dtype.itemsize * a.shape[1]))).reshape(-1)
    _, first, inv = np.unique(v, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)


def _compress(T: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge byte classes whose columns are equal."""
    first, inv = _unique_rows(T.T)
    return np.ascontiguousarray(T[:, first]), inv[classes]


# --- entry points ---------------------------------------------------------------------------------


def compile_node(node, deadline: float | None = None) -> Dfa:
    """A node (see regex.py) as a minimal live DFA."""
    nfa = _Nfa(deadline)
    start, final = nfa.new(), nfa.new()
    nfa.add(node, start, final)
    check_deadline(deadline)
    T, acc, classes = _determinize(nfa, start, final, deadline)
    check_deadline(deadline)
    T, acc = prune_and_minimize(T, acc, reachable_known=True, deadline=deadline)
    T, classes = _compress(T, classes)
    return Dfa(T, classes, acc)


def intersect(a: Dfa, b: Dfa, deadline: float | None = None) -> Dfa:
    """The product automaton: strings both accept."""
    kb = b.table.shape[1]
    uniq, joint = np.unique(a.classes * kb + b.classes, return_inverse=True)
    ca, cb = uniq // kb, uniq % kb
    ids = {(0, 0): 0}
    order = [(0, 0)]
    rows = []
    i = 0
    while i < len(order):
        if i % 256 == 0:
            _check_growth(len(order), deadline)
        sa, sb = order[i]
        i += 1
        ta, tb = a.table[sa, ca].tolist(), b.table[sb, cb].tolist()
        out = []
        for x, y in zip(ta, tb):
            if x < 0 or y < 0:
                out.append(DEAD)
                continue
            j = ids.get((x, y))
            if j is None:
                j = ids[(x, y)] = len(order)
                order.append((x, y))
            out.append(j)
        rows.append(out)
    T = np.asarray(rows, dtype=np.int32).reshape(len(order), len(uniq))
    acc = np.array([bool(a.accepting[x] and b.accepting[y]) for x, y in order], dtype=bool)
    if not acc.any():
        raise GrammarCompileError("the grammar accepts no string")
    T, acc = prune_and_minimize(T, acc, reachable_known=True, deadline=deadline)
    T, classes = _compress(T, joint.reshape(-1))
    return Dfa(T, classes, acc)
