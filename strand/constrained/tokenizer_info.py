"""What the grammar compiler needs to know about a tokenizer: each token's bytes, EOS, specials.

Also builds (once per tokenizer) a byte trie of the vocabulary, so the token index walks shared
token prefixes through a DFA once instead of once per token.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from dataclasses import dataclass, field

import numpy as np


@functools.lru_cache(maxsize=1)
def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in char of each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _token_bytes_byte_level(piece: str) -> bytes | None:
    table = _gpt2_unicode_to_byte()
    try:
        return bytes(table[ch] for ch in piece)
    except KeyError:
        return None


def _token_bytes_sentencepiece(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True, eq=False)
class VocabTrie:
    """Byte trie of the vocabulary, nodes numbered level by level (children of a node contiguous).

    Node i (0-based, the root is not a node) spells the bytes of its parent plus `byte[i]`.
    """

    byte: np.ndarray  # int32 [N] last byte of the node's prefix
    depth_start: np.ndarray  # int64 [D+2] nodes of depth d are depth_start[d]:depth_start[d+1] (d>=1)
    child_start: np.ndarray  # int64 [N] first child node id
    child_count: np.ndarray  # int64 [N]
    node_token: np.ndarray  # int32 [N] a token id whose bytes are this prefix, -1 if none
    dup_node: np.ndarray  # int32 [K] extra (node, token) pairs for tokens with identical bytes
    dup_token: np.ndarray  # int32 [K]

    @property
    def num_nodes(self) -> int:
        return len(self.byte)


def _build_trie(token_bytes: list[bytes | None], usable: np.ndarray) -> VocabTrie:
    by_bytes: dict[bytes, list[int]] = {}
    for tid, tb in enumerate(token_bytes):
        if usable[tid] and tb:
            by_bytes.setdefault(tb, []).append(tid)
    prefixes_by_len: dict[int, set[bytes]] = {}
    for tb in by_bytes:
        for n in range(1, len(tb) + 1):
            prefixes_by_len.setdefault(n, set()).add(tb[:n])
    max_len = max(prefixes_by_len)
    node_id: dict[bytes, int] = {}
    byte_l, parent_l = [], []
    depth_start = [0, 0]
    for n in range(1, max_len + 1):
        level = prefixes_by_len.get(n, set())
        if n == 1:
            ordered = sorted(level)
        else:
            ordered = sorted(level, key=lambda p: (node_id[p[:-1]], p[-1]))
        for p in ordered:
            node_id[p] = len(byte_l)
            byte_l.append(p[-1])
            parent_l.append(node_id[p[:-1]] if n > 1 else -1)
        depth_start.append(len(byte_l))
    num = len(byte_l)
    parent = np.asarray(parent_l, dtype=np.int64)
    child_count = np.bincount(parent[parent >= 0], minlength=num).astype(np.int64)
    child_start = np.zeros(num, dtype=np.int64)
    # Children are contiguous and ordered like their parents, so the first child of each parent
    # is found where its run begins.
    has_parent = np.nonzero(parent >= 0)[0]
    if len(has_parent):
        runs = np.r_[True, parent[has_parent][1:] != parent[has_parent][:-1]]
        child_start[parent[has_parent][runs]] = has_parent[runs]
    node_token = np.full(num, -1, dtype=np.int32)
    dup_n, dup_t = [], []
    for tb, tids in by_bytes.items():
        nid = node_id[tb]
        node_token[nid] = tids[0]
        for t in tids[1:]:
            dup_n.append(nid)
            dup_t.append(t)
    return VocabTrie(
        byte=np.asarray(byte_l, dtype=np.int32),
        depth_start=np.asarray(depth_start, dtype=np.int64),
        child_start=child_start,
        child_count=child_count,
        node_token=node_token,
        dup_node=np.asarray(dup_n, dtype=np.int32),
        dup_token=np.asarray(dup_t, dtype=np.int32),
    )


def _utf8_char_len(data: bytes, i: int) -> int:
    """Length of the complete, valid UTF-8 character at data[i:], or 0."""
    b0 = data[i]
    if b0 < 0x80:
        return 1
    if 0xC2 <= b0 <= 0xDF:
        n, lo, hi = 2, 0x80, 0xBF
    elif 0xE0 <= b0 <= 0xEF:
        n = 3
        lo, hi = (0xA0, 0xBF) if b0 == 0xE0 else (0x80, 0x9F) if b0 == 0xED else (0x80, 0xBF)
    elif 0xF0 <= b0 <= 0xF4:
        n = 4
        lo, hi = (0x90, 0xBF) if b0 == 0xF0 else (0x80, 0x8F) if b0 == 0xF4 else (0x80, 0xBF)
    else:
        return 0
    if i + n > len(data) or not lo <= data[i + 1] <= hi:
        return 0
    if any(not 0x80 <= data[i + k] <= 0xBF for k in range(2, n)):
        return 0
    return n


class TokenTable:
    """The vocabulary as arrays, for classifying every token against a character class at once.

    For each token, its leading complete UTF-8 characters: `codes[t, k]` is the k-th character's
    byte if ASCII, 256 if non-ASCII, 257 past the last complete character; `char_end[t, k]` is
    the byte offset after k characters. Unusable tokens (None bytes) have no characters and
    length 0.
    """

    def __init__(self, token_bytes):
        V = len(token_bytes)
        L = max((len(tb) for tb in token_bytes if tb), default=1)
        self.bytes = np.zeros((V, L), dtype=np.uint8)
        self.length = np.zeros(V, dtype=np.int64)
        self.usable = np.zeros(V, dtype=bool)
        codes = np.full((V, L + 1), 257, dtype=np.int16)
        char_end = np.zeros((V, L + 1), dtype=np.int64)
        for t, tb in enumerate(token_bytes):
            if not tb:
                continue
            self.usable[t] = True
            self.length[t] = len(tb)
            self.bytes[t, : len(tb)] = np.frombuffer(tb, dtype=np.uint8)
            i = k = 0
            while i < len(tb):
                n = _utf8_char_len(tb, i)
                if n == 0:
                    break
                codes[t, k] = tb[i] if n == 1 else 256
                i += n
                k += 1
                char_end[t, k] = i
            char_end[t, k + 1 :] = i
        self.codes = codes
        self.char_end = char_end
        first = np.where(self.usable, self.bytes[:, 0].astype(np.int64), 256)
        order = np.argsort(first, kind="stable")
        self.by_first = order  # usable tokens sorted by first byte: by_first_start[b]:by_first_start[b+1]
        self.by_first_start = np.searchsorted(first[order], np.arange(258))
        self.max_chars = L
        self._classified: dict = {}
        self._lock = threading.Lock()

    def classify(self, key: bytes) -> "TokenClasses":
        """key: 129 bytes, key[b] = 1 if ASCII byte b is in the class, key[128] = 1 if every
        non-ASCII character is. Cached per key."""
        with self._lock:
            hit = self._classified.get(key)
        if hit is None:
            k = np.frombuffer(key, dtype=np.uint8).astype(bool)
            lut = np.zeros(258, dtype=bool)
            lut[:128], lut[256] = k[:128], k[128]
            hit = TokenClasses(self, lut[self.codes])
            with self._lock:
                if len(self._classified) >= 64:
                    self._classified.pop(next(iter(self._classified)))
                self._classified[key] = hit
        return hit


class TokenClasses:
    """Every token against one character class.

    c[t]: how many leading characters of token t are in the class; pure[t]: all of it is.
    The usable tokens that are not pure, sorted by (c, the byte where the class ends): `broken`,
    with `group_c`, `group_byte` and `group_start` (CSR) describing the runs. `by_c` orders all
    usable tokens by c (`c_sorted` ascending) to find those with c above a bound.
    """

    def __init__(self, table: TokenTable, inside: np.ndarray):
        V = len(table.length)
        c = np.argmin(inside, axis=1)  # the last column is always outside
        end = table.char_end[np.arange(V), c]
        self.c = c
        self.pure = table.usable & (end == table.length)
        # the same from the second character on (for a state whose one live byte leads into a
        # chain): c1 class characters after the first, pure1 = the rest of the token is all such
        c1 = np.argmin(inside[:, 1:], axis=1)
        self.c1 = c1
        self.pure1 = table.usable & (table.char_end[np.arange(V), np.minimum(c1 + 1, inside.shape[1] - 1)] == table.length)
        broken = np.nonzero(table.usable & ~self.pure)[0]
        brk = table.bytes[broken, np.minimum(end[broken], table.bytes.shape[1] - 1)].astype(np.int64)
        key = c[broken] * 256 + brk
        order = np.argsort(key, kind="stable")
        self.broken, key = broken[order], key[order]
        starts = np.r_[0, np.nonzero(key[1:] != key[:-1])[0] + 1] if len(key) else np.zeros(0, np.int64)
        self.group_start = np.r_[starts, len(key)].astype(np.int64)
        self.group_c = key[starts] // 256
        self.group_byte = key[starts] % 256
        usable = np.nonzero(table.usable)[0]
        o = np.argsort(c[usable], kind="stable")
        self.by_c = usable[o]
        self.c_sorted = c[usable][o]


@dataclass(frozen=True, eq=False)
class TokenizerInfo:
    """Per-token bytes of a tokenizer, padded to the model's logits width.

    `token_bytes[i]` is None for ids that can never be emitted under a grammar: special tokens
    (EOS is handled separately), tokens with no bytes, and ids past the tokenizer's vocabulary.
    """

    token_bytes: tuple  # tuple[bytes | None, ...], len == vocab_size
    eos_token_ids: frozenset
    special_token_ids: frozenset
    vocab_size: int
    fingerprint: str = field(default="")

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, eos_token_ids=None) -> "TokenizerInfo":
        n_tok = len(tokenizer)
        vocab_size = n_tok if vocab_size is None else int(vocab_size)
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials |= {i for i, t in added.items() if getattr(t, "special", False)}
        eos = set(eos_token_ids or [])
        if not eos and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        pieces = tokenizer.convert_ids_to_tokens(list(range(n_tok)))
        byte_level = _looks_byte_level(tokenizer, pieces)
        out: list[bytes | None] = []
        for tid in range(vocab_size):
            if tid >= n_tok or tid in specials or pieces[tid] is None:
                out.append(None)
                continue
            piece = pieces[tid]
            if tid in added:  # non-special added tokens are stored as plain text
                tb = added[tid].content.encode("utf-8")
            elif byte_level:
                tb = _token_bytes_byte_level(piece)
            else:
                tb = _token_bytes_sentencepiece(piece)
            out.append(tb or None)
        h = hashlib.sha1()
        for tb in out:
            h.update(b"\xff\x00" if tb is None else len(tb).to_bytes(2, "little") + tb)
        h.update(repr((sorted(eos), vocab_size)).encode())
        return cls(tuple(out), frozenset(eos), frozenset(specials), vocab_size, h.hexdigest())

    @property
    def num_words(self) -> int:
        return (self.vocab_size + 31) // 32

    @functools.cached_property
    def trie(self) -> VocabTrie:
        usable = np.array([tb is not None for tb in self.token_bytes], dtype=bool)
        return _build_trie(list(self.token_bytes), usable)

    @functools.cached_property
    def token_table(self) -> TokenTable:
        return TokenTable(self.token_bytes)

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenizerInfo) and other.fingerprint == self.fingerprint


def _looks_byte_level(tokenizer, pieces: list) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and "ByteLevel" in repr(getattr(backend, "decoder", "")):
        return True
    sample = [p for p in pieces[:5000] if p]
    return sum("Ġ" in p for p in sample) > sum("\u2581" in p for p in sample)
