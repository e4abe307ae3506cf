"""Regular expressions as a small tree of nodes over Unicode code points.

A node is a hashable tuple:

    ("l", b"...")           a literal byte string (UTF-8)
    ("c", ((lo, hi), ...))  one character from a set of code-point intervals
    ("s", (node, ...))      concatenation; ("s", ()) is the empty string
    ("a", (node, ...))      alternation; ("a", ()) is the empty language
    ("r", node, lo, hi)     repetition, hi None = unbounded
    ("d", dfa)              an already-built automaton (see automaton.Dfa)
    ("^",) / ("$",)         anchors, only while parsing (removed by `fullmatch` / `search`)

Python's own parser (`re._parser`) reads the pattern, so the syntax and the escapes are exactly
those of `re`; what a pattern matches here is always a subset of what `re.fullmatch` (or, for JSON
Schema, `re.search`) matches, and equal to it except where a comment says otherwise.
"""

from __future__ import annotations

import functools
import re

try:  # Python 3.11+
    import re._constants as C
    import re._parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as C
    import sre_parse

from strand.constrained.errors import GrammarCompileError

MAX_CP = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # not encodable in UTF-8, never part of a set

EPS = ("s", ())
NEVER = ("a", ())


# --- character sets: sorted, disjoint, non-adjacent (lo, hi) intervals ----------------------


def cs_norm(ivs) -> tuple:
    out: list[list[int]] = []
    for lo, hi in sorted(ivs):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    res = []
    s_lo, s_hi = _SURROGATES
    for lo, hi in out:  # cut the surrogate block out
        if hi < s_lo or lo > s_hi:
            res.append((lo, hi))
            continue
        if lo < s_lo:
            res.append((lo, s_lo - 1))
        if hi > s_hi:
            res.append((s_hi + 1, hi))
    return tuple(res)


def cs_union(*sets) -> tuple:
    return cs_norm([iv for s in sets for iv in s])


def cs_complement(s) -> tuple:
    out, nxt = [], 0
    for lo, hi in s:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return cs_norm(out)


def cs_intersect(a, b) -> tuple:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def cs_of(text: str) -> tuple:
    return cs_norm((ord(c), ord(c)) for c in text)


ANY_CHAR = cs_norm([(0, MAX_CP)])
_ASCII_DIGIT = cs_norm([(0x30, 0x39)])
_ASCII_WORD = cs_norm([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
_ASCII_SPACE = cs_norm([(0x09, 0x0D), (0x20, 0x20)])


@functools.lru_cache(maxsize=None)
def _unicode_class(name: str) -> tuple:
    """The exact set `re` matches for \\d, \\w or \\s on str patterns (scanned once)."""
    pred = {"d": str.isdecimal, "w": lambda c: c.isalnum() or c == "_", "s": str.isspace}[name]
    ivs, start = [], None
    for cp in range(MAX_CP + 2):
        inside = cp <= MAX_CP and not (0xD800 <= cp <= 0xDFFF) and pred(chr(cp))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ivs.append((start, cp - 1))
            start = None
    return cs_norm(ivs)


# --- node constructors ------------------------------------------------------------------------


def lit(text: str | bytes):
    b = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return ("l", b) if b else EPS


def chars(ivs):
    ivs = cs_norm(ivs)
    if not ivs:
        return NEVER
    if len(ivs) == 1 and ivs[0][0] == ivs[0][1]:
        return ("l", chr(ivs[0][0]).encode("utf-8"))
    return ("c", ivs)


def seq(*parts):
    items = []
    for p in parts:
        if p == NEVER:
            return NEVER
        if p[0] == "s":
            items.extend(p[1])
        else:
            items.append(p)
    merged = []  # adjacent literals become one
    for p in items:
        if merged and p[0] == "l" and merged[-1][0] == "l":
            merged[-1] = ("l", merged[-1][1] + p[1])
        else:
            merged.append(p)
    return merged[0] if len(merged) == 1 else ("s", tuple(merged))


def alt(*parts):
    items = []
    for p in parts:
        if p[0] == "a":
            items.extend(p[1])
        else:
            items.append(p)
    items = list(dict.fromkeys(items))
    return items[0] if len(items) == 1 else ("a", tuple(items))


def rep(p, lo: int, hi: int | None):
    if hi is not None and (hi < lo or hi == 0):
        return EPS if hi == 0 or lo == 0 else NEVER
    if p == NEVER:
        return EPS if lo == 0 else NEVER
    if p == EPS or (lo == hi == 1):
        return p
    return ("r", p, lo, hi)


def opt(p):
    return rep(p, 0, 1)


def map_chars(node, fn):
    """The node with every character set s replaced by fn(s) (literals are sets of one)."""
    kind = node[0]
    if kind == "c":
        return chars(fn(node[1]))
    if kind == "l":
        text = node[1].decode("utf-8")
        return seq(*[chars(fn(((ord(ch), ord(ch)),))) for ch in text])
    if kind in ("s", "a"):
        items = [map_chars(p, fn) for p in node[1]]
        return seq(*items) if kind == "s" else alt(*items)
    if kind == "r":
        return rep(map_chars(node[1], fn), node[2], node[3])
    if kind == "d":
        raise GrammarCompileError("internal: map_chars over a built automaton")
    return node


# --- parsing ------------------------------------------------------------------------------------

_UNSUPPORTED = {
    C.GROUPREF: "backreferences",
    C.GROUPREF_EXISTS: "conditional groups",
    C.ASSERT: "lookaround assertions",
    C.ASSERT_NOT: "lookaround assertions",
}
for _name, _what in (("POSSESSIVE_REPEAT", "possessive quantifiers"), ("ATOMIC_GROUP", "atomic groups")):
    if hasattr(C, _name):
        _UNSUPPORTED[getattr(C, _name)] = _what


@functools.lru_cache(maxsize=4096)
def parse(pattern: str, flags: int = 0):
    """Parse a Python regex into a node; anchors stay as ("^",)/("$",) nodes."""
    if not isinstance(pattern, str):
        raise GrammarCompileError(f"regex: pattern must be a string, got {type(pattern).__name__}")
    try:
        tree = sre_parse.parse(pattern, flags)
    except re.error as e:
        raise GrammarCompileError(f"regex: invalid pattern {pattern!r}: {e}") from None
    except RecursionError:
        raise GrammarCompileError(f"regex: pattern {pattern[:40]!r}... nests too deeply") from None
    fl = tree.state.flags
    if fl & re.LOCALE:
        raise GrammarCompileError("regex: the LOCALE flag is not supported")
    try:
        return _conv(tree, fl, pattern)
    except RecursionError:
        raise GrammarCompileError(f"regex: pattern {pattern[:40]!r}... nests too deeply") from None


def _conv(sub, flags: int, pattern: str):
    return seq(*[_conv_item(op, av, flags, pattern) for op, av in sub])


def _fold(s: tuple, flags: int) -> tuple:
    """Case variants under IGNORECASE: ASCII letters exactly, others by simple one-char
    lower/upper (a subset of re's case folding, so the positive set stays sound)."""
    if not flags & re.IGNORECASE:
        return s
    extra = []
    for lo, hi in s:
        for a, b, d in ((0x41, 0x5A, 0x20), (0x61, 0x7A, -0x20)):
            x, y = max(lo, a), min(hi, b)
            if x <= y:
                extra.append((x + d, y + d))
        if hi >= 0x80 and not flags & re.ASCII:
            if hi - max(lo, 0x80) > 5000:
                raise GrammarCompileError("regex: IGNORECASE over a wide non-ASCII range is not supported")
            for cp in range(max(lo, 0x80), hi + 1):
                ch = chr(cp)
                for v in (ch.lower(), ch.upper()):
                    if len(v) == 1 and v != ch:
                        extra.append((ord(v), ord(v)))
    return cs_union(s, extra)


# Non-ASCII characters that re's IGNORECASE folds onto ASCII letters (i, k, s).
_FOLDS_TO_ASCII = cs_norm([(0x130, 0x131), (0x17F, 0x17F), (0x212A, 0x212A)])


def _negate(s: tuple, flags: int) -> tuple:
    if flags & re.IGNORECASE:
        if any(hi >= 0x80 for _, hi in s) and not flags & re.ASCII:
            raise GrammarCompileError("regex: a negated non-ASCII set under IGNORECASE is not supported")
        s = cs_union(_fold(s, flags), _FOLDS_TO_ASCII if not flags & re.ASCII else ())
    return cs_complement(s)


def _category(cat, flags: int, exact: bool) -> tuple:
    """A \\d \\w \\s (or negation) set. exact=False allows a subset (ASCII) for the positive
    classes, which keeps non-negated sets small; negations are always exact."""
    ascii_mode = bool(flags & re.ASCII)
    base = {
        C.CATEGORY_DIGIT: ("d", False), C.CATEGORY_NOT_DIGIT: ("d", True),
        C.CATEGORY_WORD: ("w", False), C.CATEGORY_NOT_WORD: ("w", True),
        C.CATEGORY_SPACE: ("s", False), C.CATEGORY_NOT_SPACE: ("s", True),
    }.get(cat)
    if base is None:
        raise GrammarCompileError(f"regex: character category {cat} is not supported")
    name, negated = base
    ascii_set = {"d": _ASCII_DIGIT, "w": _ASCII_WORD, "s": _ASCII_SPACE}[name]
    if ascii_mode or (not negated and not exact):
        full = ascii_set
    else:
        full = _unicode_class(name)
    return cs_complement(full) if negated else full


def _class_set(items, flags: int) -> tuple:
    negate = bool(items) and items[0][0] is C.NEGATE
    parts = []
    for op, av in items[1:] if negate else items:
        if op is C.LITERAL:
            parts.append((av, av))
        elif op is C.RANGE:
            parts.append(av)
        elif op is C.CATEGORY:
            parts.extend(_category(av, flags, exact=negate))
        else:
            raise GrammarCompileError(f"regex: {op} inside a character class is not supported")
    s = cs_norm(parts)
    return _negate(s, flags) if negate else _fold(s, flags)


def _conv_item(op, av, flags: int, pattern: str):
    if op is C.LITERAL:
        return chars(_fold(((av, av),), flags))
    if op is C.NOT_LITERAL:
        return chars(_negate(((av, av),), flags))
    if op is C.ANY:
        return chars(ANY_CHAR if flags & re.DOTALL else cs_complement(((0x0A, 0x0A),)))
    if op is C.IN:
        return chars(_class_set(av, flags))
    if op is C.BRANCH:
        return alt(*[_conv(b, flags, pattern) for b in av[1]])
    if op is C.SUBPATTERN:
        _group, add, rem, sub = av
        return _conv(sub, (flags | add) & ~rem, pattern)
    if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # laziness does not change the language
        lo, hi, sub = av
        return rep(_conv(sub, flags, pattern), lo, None if hi is C.MAXREPEAT else hi)
    if op is C.AT:
        if flags & re.MULTILINE and av in (C.AT_BEGINNING, C.AT_END):
            raise GrammarCompileError("regex: ^/$ under MULTILINE are not supported")
        if av in (C.AT_BEGINNING, C.AT_BEGINNING_STRING):
            return ("^",)
        if av in (C.AT_END, C.AT_END_STRING):
            return ("$",)
        raise GrammarCompileError(f"regex: {av} (word boundary) is not supported in {pattern!r}")
    what = _UNSUPPORTED.get(op, str(op))
    raise GrammarCompileError(f"regex: {what} are not supported in {pattern!r}")


# --- anchors ---------------------------------------------------------------------------------


def _has_anchor(node) -> bool:
    kind = node[0]
    if kind in ("^", "$"):
        return True
    if kind in ("s", "a"):
        return any(_has_anchor(p) for p in node[1])
    if kind == "r":
        return _has_anchor(node[1])
    return False


def _branch_anchors(node):
    """(anchored at start, body, anchored at end) for one top-level branch."""
    items = list(node[1]) if node[0] == "s" else [node]
    start = end = False
    while items and items[0] == ("^",):
        items.pop(0)
        start = True
    while items and items[-1] == ("$",):
        items.pop()
        end = True
    # ^(...)$ with a single group whose branches are not anchored further
    body = seq(*items) if items else EPS
    if _has_anchor(body):
        if body[0] == "a" and len(items) == 1:
            return [(start or s2, b2, end or e2) for bb in body[1] for s2, b2, e2 in _branch_anchors(bb)]
        raise GrammarCompileError("regex: ^ and $ are supported only at the start and end of the pattern")
    return [(start, body, end)]


def _branches(node):
    return [t for b in (node[1] if node[0] == "a" else [node]) for t in _branch_anchors(b)]


def fullmatch(node):
    """The language of re.fullmatch: anchors at the ends mean nothing more."""
    if not _has_anchor(node):
        return node
    return alt(*[body for _, body, _ in _branches(node)])


def search(node, sigma: tuple):
    """The strings over `sigma` that contain a match of `node` (re.search semantics), with the
    node's own character sets cut to sigma."""
    anything = rep(chars(sigma), 0, None)
    out = []
    for start, body, end in _branches(node):
        body = map_chars(body, lambda s: cs_intersect(s, sigma))
        out.append(seq(EPS if start else anything, body, EPS if end else anything))
    return alt(*out)


def regex_node(pattern: str):
    """A full-match regex (the `regex` constraint) as a node."""
    return fullmatch(parse(pattern))
