"""The regex front end and the byte DFA against Python's `re`, and the fast token index against
a token-by-token walk of the vocabulary."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from strand.constrained import GrammarCompileError, GrammarCompiler, TokenizerInfo
from strand.constrained import automaton as A
from strand.constrained import regex as R
from strand.constrained.fsm import build_token_index, build_token_index_exact

PATTERNS = [
    r"[0-9]+(\.[0-9]+)?", r"a|b|cd", r"(ab)*c{2,4}", r'[^"\\]*', r"\d{3}-\w+", r"é+[α-ω]*",
    r"(?i)abc", r".{0,3}", r"x[\u0100-\uffff]y", r"\D+", r"[^\d\s]+", r"^(a|b)+$", r"(foo|bar)?baz",
    r"[^a-c]{2}", r"(?:x|y)*?z", r"\S\s?", r"[\w.-]+@\w+\.com", r"(a{2,3}){2}", r"\.\*\?", r"[]a]+",
]
ALPHABET = list("abcdxyzABC0129.-_@ \n\t\"\\*?]") + ["é", "α", "ω", "ÿ", "一", "😀", "٣", "\u00a0"]


def dfa_fullmatch(dfa: A.Dfa, text: str) -> bool:
    T, q = dfa.byte_table(), 0
    for b in text.encode("utf-8"):
        q = T[q, b]
        if q < 0:
            return False
    return bool(dfa.accepting[q])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_agrees_with_re_fullmatch(pattern):
    dfa = A.compile_node(R.regex_node(pattern))
    rng = random.Random(pattern)
    samples = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7))) for _ in range(3000)]
    hits = 0
    for s in samples:
        want = re.fullmatch(pattern, s) is not None
        got = dfa_fullmatch(dfa, s)
        # \d \w \s are narrowed to ASCII outside negations: a subset, never a superset
        assert not got or want, (pattern, s)
        if want and not got:
            assert any(ord(ch) > 0x7F for ch in s), (pattern, s)
        hits += got
    assert dfa.num_states >= 1


def test_utf8_ranges_exact():
    for lo, hi in [(0x80, 0x10FFFF), (0x7F, 0x800), (0xE000, 0x10FFFF), (0x400, 0x4FF), (0xFFF0, 0x10010)]:
        dfa = A.compile_node(R.chars(((lo, hi),)))
        for cp in list(range(lo - 200, lo + 200)) + list(range(hi - 200, min(hi + 200, 0x110000))):
            if cp < 0 or 0xD800 <= cp <= 0xDFFF:
                continue
            assert dfa_fullmatch(dfa, chr(cp)) == (lo <= cp <= hi), hex(cp)
        T = dfa.byte_table()
        assert T[0, 0xC0] < 0 and T[0, 0xF5] < 0 and T[0, 0x80] < 0  # never an invalid lead


def test_search_semantics_for_json_patterns():
    sigma = R.cs_complement(R.cs_union(R.cs_of('"\\'), ((0, 0x1F),)))
    for pattern in [r"^[A-Z]{2}\d+$", r"ab", r"^x", r"y$", r"(LATEX|MATHML)", r"^(a|b)$|c"]:
        dfa = A.compile_node(R.search(R.parse(pattern), sigma))
        rng = random.Random(pattern)
        for _ in range(2000):
            s = "".join(rng.choice("abcxyAZ19LATEXMH ") for _ in range(rng.randint(0, 8)))
            assert dfa_fullmatch(dfa, s) == (re.search(pattern, s) is not None), (pattern, s)


@pytest.mark.parametrize("pattern, what", [
    (r"(a)\1", "backreferences"), (r"a(?=b)", "lookaround"), (r"\bword", "boundary"), (r"a^b", "start and end"),
])
def test_unsupported_regex_is_a_clear_error(pattern, what):
    with pytest.raises(GrammarCompileError, match=what):
        A.compile_node(R.regex_node(pattern))


def test_intersection():
    a = A.compile_node(R.regex_node(r"[a-z]*x[a-z]*"))
    b = A.compile_node(R.regex_node(r"[a-z]{2,4}"))
    both = A.intersect(a, b)
    for s in ["x", "ax", "axb", "abxd", "abcdx", "abcde", "xx"]:
        assert dfa_fullmatch(both, s) == bool(re.fullmatch(r"[a-z]*x[a-z]*", s) and re.fullmatch(r"[a-z]{2,4}", s))


def test_minimal_dfa_merges_equal_tails():
    dfa = A.compile_node(R.regex_node(r'(?:"red"|"green"|"blue")'))
    # a minimal DFA for the three words: the shared start and end, and one path per word
    assert dfa.num_states == 1 + (3 + 4 + 3) + 1 + 1


@pytest.fixture(scope="module")
def info():
    from strand.runtime.tokenizer import load_tokenizer

    return TokenizerInfo.from_tokenizer(load_tokenizer())


def brute_force_mask(T, acc, info) -> np.ndarray:
    S, W = T.shape[0], info.num_words
    mask = np.zeros((S, W), dtype=np.uint32)
    for t, tb in enumerate(info.token_bytes):
        if not tb:
            continue
        for q in range(S):
            s = q
            for b in tb:
                s = T[s, b]
                if s < 0:
                    break
            if s >= 0:
                mask[q, t >> 5] |= np.uint32(1 << (t & 31))
    for e in info.eos_token_ids:
        mask[acc, e >> 5] |= np.uint32(1 << (e & 31))
    return mask


@pytest.mark.parametrize("kind, spec", [
    ("regex", r'"[^"\\]{0,6}"'),
    ("regex", r"[a-z]+(?:-[a-z0-9]{1,5})*"),
    ("json", '{"type":"object","properties":{"name":{"type":"string","maxLength":5},"n":{"type":"integer"}},"required":["name"]}'),
])
def test_fast_index_equals_token_by_token_walk(info, kind, spec):
    g = GrammarCompiler(info).compile_now(kind, spec)
    T, acc = g.transitions, g.accepting
    ref = brute_force_mask(T, acc, info) if T.shape[0] <= 24 else build_token_index_exact(T, acc, info)
    assert np.array_equal(build_token_index(T, acc, info), ref)
    assert np.array_equal(build_token_index_exact(T, acc, info), ref)
