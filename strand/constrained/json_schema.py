"""JSON schema -> regex node (see regex.py); an intersection inside a string becomes a built DFA.

What is generated is always a subset of what the schema accepts, chosen so that the subset is
still useful: properties in declared order, no undeclared properties, bounded nesting for free
JSON values. A keyword that constrains instances but that the converter cannot enforce exactly
raises GrammarCompileError naming it; annotations and unknown (non-vocabulary) keywords are
ignored, as validators ignore them.

Some keywords are enforced by narrowing: oneOf branches are narrowed until no other branch
accepts what one generates; dependencies, `not` and if/then/else are folded into the schema as
restrictions (e.g. a dependency is required whenever its property may be generated).
"""

from __future__ import annotations

import functools
import json
import math
import re

from strand.constrained import regex as R
from strand.constrained.automaton import check_deadline, compile_node, intersect
from strand.constrained.errors import GrammarCompileError

# One JSON string character: unescaped or a short escape. \uXXXX escapes are not generated: any
# character but a control character can be written as itself, and the four hex states they add
# to every string cost more mask work than they give (a narrowing: every output stays valid).
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])'
SAFE_CHAR = r'[^"\\\x00-\x1f]'  # characters that stand for themselves inside a JSON string
STRING = '"' + STRING_CHAR + '*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
FRAC = r"(?:\.[0-9]+)?"
ZERO_FRAC = r"(?:\.0+)?"
NONZERO_FRAC = r"\.[0-9]*[1-9][0-9]*"

_DATE = r"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,20}[A-Za-z0-9])?"
_URI_CHARS = r"(?:[A-Za-z0-9._~:/?#@!$&'()*+,;=-]|%[0-9A-Fa-f]{2})"
_IPV4_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "T" + _TIME,
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "email": r"[A-Za-z0-9_+-]+(?:\.[A-Za-z0-9_+-]+)*@" + _LABEL + r"(?:\." + _LABEL + r")+",
    "hostname": _LABEL + r"(?:\." + _LABEL + r")*",
    "ipv4": _IPV4_OCTET + r"(?:\." + _IPV4_OCTET + r"){3}",
    "uri": r"[a-z][a-z0-9+.-]*://" + _LABEL + r"(?:\." + _LABEL + r")*(?:/[A-Za-z0-9._~-]*)*",
    "uri-reference": r"(?:[a-z][a-z0-9+.-]*://" + _LABEL + r"(?:\." + _LABEL + r")*)?(?:/[A-Za-z0-9._~-]*)*",
}
# Formats a validator may check that we cannot generate: refuse. Others are unknown to
# validators (int32, binary, ...) and so assert nothing.
KNOWN_UNSUPPORTED_FORMATS = {
    "idn-email", "idn-hostname", "ipv6", "iri", "iri-reference", "uri-template", "regex",
    "json-pointer", "relative-json-pointer", "duration", "color",
}

ANNOTATIONS = {
    "title", "description", "examples", "default", "$schema", "$id", "id", "$comment", "$anchor",
    "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "contentSchema",
    "$defs", "definitions", "$vocabulary", "$dynamicAnchor", "$recursiveAnchor",
}
# Vocabulary keywords never enforced here (others have conditions, checked where they apply).
REFUSED = {"contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef"}
DEPENDENCY_KEYWORDS = {"dependencies", "dependentRequired", "dependentSchemas"}
# Keywords whose subschemas decide which properties an instance may have.
COMBINATORS = {"$ref", "allOf", "anyOf", "oneOf"}
TYPE_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "object": {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties", "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
               "unevaluatedProperties"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems"},
}
# Bounded repetitions above these are tightened (sound: fewer outputs, all valid); the DFA has a
# state per count, so maxLength 32767 would otherwise mean 32767 mask rows.
MAX_STRING_LENGTH = 128
MAX_ITEMS = 32
MAX_MULTIPLES = 64  # values generated for a multipleOf other than 1
ALL_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


NEVER = R.NEVER  # the empty language (e.g. a recursive $ref past the unroll depth)
SAFE_SET = R.cs_complement(R.cs_union(R.cs_of('"\\'), ((0, 0x1F),)))


def json_literal(value):
    return R.lit(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


# --- the node algebra ------------------------------------------------------------------------
# Parts are regex strings (parsed once, cached) or nodes of strand.constrained.regex; results are
# nodes. NEVER (the empty language) is one object, so `x is NEVER` tests for it.


def _n(p):
    return R.fullmatch(R.parse(p)) if isinstance(p, str) else p


def _canon(node):
    return NEVER if node == NEVER else node


def seq(*parts):
    return _canon(R.seq(*[_n(p) for p in parts]))


def alt(*parts):
    return _canon(R.alt(*[_n(p) for p in parts]))


def opt(p):
    return _canon(R.opt(_n(p)))


def rep(p, lo: int, hi: int | None):
    return _canon(R.rep(_n(p), lo, hi))


# --- numbers ---------------------------------------------------------------------------------


def _same_len_range(a: str, b: str) -> str:
    """Regex for decimal strings of equal length n between a and b (inclusive)."""
    if a == b:
        return a
    n = len(a)
    if n == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return a[0] + _same_len_range(a[1:], b[1:])
    if a[1:] == "0" * (n - 1) and b[1:] == "9" * (n - 1):
        return f"[{a[0]}-{b[0]}][0-9]{{{n - 1}}}"
    out = [a[0] + _same_len_range(a[1:], "9" * (n - 1))]
    lo, hi = int(a[0]) + 1, int(b[0]) - 1
    if lo <= hi:
        out.append((f"[{lo}-{hi}]" if lo < hi else str(lo)) + f"[0-9]{{{n - 1}}}")
    out.append(b[0] + _same_len_range("0" * (n - 1), b[1:]))
    return "(?:" + "|".join(out) + ")"


def int_range(lo: int, hi: int | None):
    """Regex for the decimal (no leading zeros) integers in [lo, hi], 0 <= lo; hi None = inf."""
    if hi is not None and lo > hi:
        return NEVER
    out = []
    top = len(str(hi)) if hi is not None else len(str(lo))
    for n in range(len(str(lo)), top + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = min(hi, 10**n - 1) if hi is not None else 10**n - 1
        if a <= b:
            out.append(_same_len_range(str(a), str(b)))
    if hi is None:
        n = len(str(lo))
        out.append(f"[1-9][0-9]{{{n},}}")
    return alt(*out)


def signed_int_range(lo: int | None, hi: int | None):
    parts = []
    if hi is None or hi >= 0:
        parts.append(int_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        mag_lo = 1 if hi is None or hi >= 0 else -hi
        parts.append(seq("-", int_range(mag_lo, -lo if lo is not None else None)))
    return alt(*parts)


def _mag_range(a: int, a_excl: bool, b: int | None, b_excl: bool):
    """Regex for decimal magnitudes m (int part, optional fraction) with a <(=) m <(=) b."""
    if b is not None and (a > b or (a == b and (a_excl or b_excl))):
        return NEVER
    if b is not None and a == b:
        return str(a) + ZERO_FRAC
    parts = [str(a) + (NONZERO_FRAC if a_excl else FRAC)]
    mid = int_range(a + 1, None if b is None else b - 1)
    if mid is not NEVER:
        parts.append(seq(mid, FRAC))
    if b is not None and not b_excl:
        parts.append(str(b) + ZERO_FRAC)
    return alt(*parts)


def number_range(lo: int | None, lo_excl: bool, hi: int | None, hi_excl: bool):
    """Decimal numbers (no exponent) in the interval; bounds are integers or None."""
    parts = []
    if hi is None or hi > 0 or (hi == 0 and not hi_excl):
        if lo is not None and lo >= 0:
            parts.append(_mag_range(lo, lo_excl, hi, hi_excl))
        else:
            parts.append(_mag_range(0, False, hi, hi_excl))
    if lo is None or lo < 0:
        if hi is None or hi >= 0:
            m_lo, m_lo_excl = 0, True
        else:
            m_lo, m_lo_excl = -hi, hi_excl
        m_hi = -lo if lo is not None else None
        parts.append(seq("-", _mag_range(m_lo, m_lo_excl, m_hi, lo_excl)))
    return alt(*parts)


# --- the converter -------------------------------------------------------------------------


def _count_bounds(s: dict, lo_key: str, hi_key: str, cap: int) -> tuple[int, int | None] | None:
    """(lo, hi) of a min/max count pair (lengths, items); None when no count fits.

    A minimum above `cap` is refused; a maximum above it is tightened to `cap`, which keeps every
    output valid and the DFA small.
    """
    lo = int(s.get(lo_key, 0))
    hi = s.get(hi_key)
    hi = int(hi) if hi is not None else None
    if hi is not None and hi < lo:
        return None
    if lo > cap:
        raise GrammarCompileError(f"json: {lo_key} {lo} above {cap} is not supported")
    if hi is not None and hi > cap:
        hi = cap
    return lo, hi


class JsonSchemaConverter:
    def __init__(self, whitespace: str = "compact", max_depth: int = 3, max_ws: int = 4, deadline: float | None = None,
                 max_ref_unroll: int = 2):
        self.max_depth = max_depth
        self.deadline = deadline
        self.max_ref_unroll = max_ref_unroll
        if whitespace == "compact":
            w, self.colon, self.comma = "", ":", ","
        elif whitespace == "spaced":
            w, self.colon, self.comma = "", ": ", ", "
        else:
            w = r"[ \t\n]{0,%d}" % max_ws
            self.colon, self.comma = w + ":" + w, w + "," + w
        self.lbrace, self.rbrace = r"\{" + w, w + r"\}"
        self.lbracket, self.rbracket = r"\[" + w, w + r"\]"
        self.root: dict = {}
        self._validator = None
        self._not_depth = 0
        self.index_ids(self.root)

    def convert(self, schema):
        self.root = schema if isinstance(schema, dict) else {}
        self._validator = None
        self.index_ids(self.root)
        out = self.node(schema, (), self.max_depth)
        if out is NEVER:
            raise GrammarCompileError("json: the schema accepts no value this compiler can generate "
                                      "(e.g. a required recursive $ref deeper than the unroll limit)")
        return out

    # -- dispatch --

    def node(self, schema, refs: tuple, depth: int):
        check_deadline(self.deadline)
        if schema is True or schema == {}:
            return self.any_value(depth)
        if schema is False:
            return NEVER
        if not isinstance(schema, dict):
            raise GrammarCompileError(f"json: a schema must be an object or boolean, got {type(schema).__name__}")
        bad = REFUSED & schema.keys()
        if bad and not self.only_literals(schema):
            raise GrammarCompileError(f"json: keyword {sorted(bad)[0]!r} is not supported")
        if "$ref" in schema:
            return self.ref(schema, refs, depth)
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            inlined = refs  # a $ref inlined here counts towards its unroll limit
            for branch in schema["allOf"]:
                if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
                    if inlined.count(branch["$ref"]) >= self.max_ref_unroll:
                        return NEVER
                    inlined += (branch["$ref"],)
                merged = self.merge(merged, self.deref(branch, refs))
            return self.node(merged, inlined, depth)
        if DEPENDENCY_KEYWORDS & schema.keys():
            return self.node(self.fold_dependencies(schema), refs, depth)
        if "anyOf" in schema or "oneOf" in schema:
            return self.alternatives(schema, refs, depth)
        if "enum" in schema or "const" in schema:
            return self.literals(schema)  # every sibling keyword is checked by a validator there
        if {"if", "then", "else"} & schema.keys():
            return self.node(self.fold_conditional(schema), refs, depth)
        if "not" in schema:
            return self.node(self.fold_not(schema), refs, depth)
        types = self.implied_types(schema)
        if types is None:
            return self.any_value(depth)
        if "number" in types and "integer" in types:
            types = [t for t in types if t != "integer"]
        return alt(*[self.typed(t, schema, refs, depth) for t in types])

    @staticmethod
    def only_literals(s: dict) -> bool:
        """The schema generates from its enum/const alone, each value checked by a validator."""
        return ("enum" in s or "const" in s) and not (COMBINATORS & s.keys()) and not (DEPENDENCY_KEYWORDS & s.keys())

    @staticmethod
    def implied_types(s: dict) -> list | None:
        """The types a schema's instances are generated as: its `type`, else the types its
        keywords constrain (a subset: {"minLength": 1} generates strings only); None for any."""
        types = s.get("type")
        if types is None:
            present = [t for t in ALL_TYPES if TYPE_KEYWORDS.get(t, set()) & s.keys()]
            if "integer" in present and "number" in present:
                present.remove("integer")
            return present or None
        return [types] if isinstance(types, str) else list(types)

    def typed(self, t: str, s: dict, refs: tuple, depth: int):
        if t == "string":
            return self.string(s)
        if t == "integer":
            return self.integer(s)
        if t == "number":
            return self.number(s)
        if t == "boolean":
            return "(?:true|false)"
        if t == "null":
            return "null"
        if t == "object":
            return self.object(s, refs, depth)
        if t == "array":
            return self.array(s, refs, depth)
        raise GrammarCompileError(f"json: unknown type {t!r}")

    # -- references and combinators --

    def index_ids(self, root) -> None:
        """Where `$id`/`id` and `$anchor` put schemas, for references by URI or by anchor name;
        and which $ref strings occur inside a sub-resource with its own base URI (those would
        resolve against that base, which is not tracked, so they are refused)."""
        from urllib.parse import urldefrag, urljoin
        self.ids, self.anchors, self.nested_refs = {}, {}, set()
        own = root.get("$id", root.get("id")) if isinstance(root, dict) else None
        self.base = urldefrag(own)[0] if isinstance(own, str) else ""

        def walk(x, base, nested):
            if isinstance(x, list):
                for v in x:
                    walk(v, base, nested)
                return
            if not isinstance(x, dict):
                return
            own = x.get("$id", x.get("id"))
            if isinstance(own, str):
                uri, frag = urldefrag(urljoin(base, own))
                if uri and x is not root:
                    nested, base = nested or uri != self.base, uri
                    self.ids.setdefault(uri, x)
                if frag and not frag.startswith("/"):
                    self.anchors[frag] = x if frag not in self.anchors else None  # None: ambiguous
            if isinstance(x.get("$anchor"), str):
                a = x["$anchor"]
                self.anchors[a] = x if a not in self.anchors else None
            if nested and isinstance(x.get("$ref"), str):
                self.nested_refs.add(x["$ref"])
            for k, v in x.items():
                if k not in ("enum", "const", "default", "examples"):
                    walk(v, base, nested)

        if self.base:
            self.ids[self.base] = root
        walk(root, self.base, False)

    def resolve(self, ref: str):
        from urllib.parse import unquote, urldefrag, urljoin

        if not isinstance(ref, str):
            raise GrammarCompileError(f"json: $ref {ref!r} is not a string")
        if ref in self.nested_refs:
            raise GrammarCompileError(f"json: $ref {ref!r} inside a sub-schema with its own '$id' is not supported")
        uri, frag = urldefrag(ref)
        target = self.root
        if uri:
            target = self.ids.get(urldefrag(urljoin(self.base, uri))[0])
            if target is None:
                raise GrammarCompileError(f"json: $ref {ref!r} is not supported (only references within this document)")
        frag = unquote(frag)
        if frag and not frag.startswith("/"):
            if self.anchors.get(frag) is None:
                raise GrammarCompileError(f"json: $ref {ref!r}: anchor {frag!r} is not defined (or defined twice)")
            return self.anchors[frag]
        for part in frag.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise GrammarCompileError(f"json: $ref {ref!r} cannot be resolved")
        return target

    def deref(self, schema, refs: tuple):
        """Inline a top-level $ref (for merging), leaving nested ones alone."""
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema and seen < 16:
            target = self.resolve(schema["$ref"])
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = self.merge(target if isinstance(target, dict) else {"allOf": [target]}, rest) if rest else target
            seen += 1
        return schema

    def ref(self, schema: dict, refs: tuple, depth: int):
        r = schema["$ref"]
        if refs.count(r) >= self.max_ref_unroll:
            return NEVER  # recursion cut: this branch is not generated
        target = self.resolve(r)
        rest = {k: v for k, v in schema.items() if k != "$ref" and k not in ANNOTATIONS}
        if rest:  # siblings of $ref: enforce both (valid under every draft)
            if target is False:
                return NEVER
            target = self.merge(target if isinstance(target, dict) else {}, rest)
        return self.node(target, refs + (r,), depth)

    def alternatives(self, schema: dict, refs: tuple, depth: int):
        if "anyOf" in schema and "oneOf" in schema:
            raise GrammarCompileError("json: 'anyOf' together with 'oneOf' in one schema is not supported")
        key = "anyOf" if "anyOf" in schema else "oneOf"
        rest = {k: v for k, v in schema.items() if k != key and k not in ANNOTATIONS}
        branches = []
        for b in schema[key]:
            if rest:
                b = self.merge(dict(rest), self.deref(b, refs))
            branches.append((b, refs))
        if key == "oneOf" and len(branches) > 1:
            branches = self.exclusive([b for b, _ in branches], refs)
        return alt(*[self.node(b, r, depth) for b, r in branches])

    # -- oneOf: each branch generates only values that no other branch accepts --

    def exclusive(self, branches: list, refs: tuple) -> list:
        """(schema, refs) per oneOf branch, each narrowed where needed so that nothing it generates
        is valid under another branch; refuses when that cannot be shown. Narrowing keeps a
        subset of the branch: literals another branch accepts are dropped, an optional property
        another branch requires is forbidden, or one whose value no other branch accepts is
        required."""
        flats = [self.flat(b, fold=True) for b in branches]
        out = []
        for i, b in enumerate(branches):
            cur = flats[i]
            narrowed = False
            for j, other in enumerate(branches):
                if j == i:
                    continue
                for _ in range(4):
                    if self.excludes(cur, other):
                        break
                    cur = self.narrow(cur, flats[j])
                    narrowed = True
                    if cur is None:
                        break
                if cur is None or not self.excludes(cur, other):
                    raise GrammarCompileError(f"json: 'oneOf' with branches that may overlap (branch {i} vs {j}) "
                                              "is not supported (use anyOf)")
            if narrowed:  # the branch's own $ref counts towards the unroll limit as before
                own = (b["$ref"],) if isinstance(b, dict) and isinstance(b.get("$ref"), str) else ()
                out.append((cur, refs + own))
            else:
                out.append((b, refs))
        return out

    def flat(self, s, hops: int = 0, fold: bool = False):
        """s with its top-level $ref and allOf merged in; None when they cannot be merged. With
        `fold`, a top-level `not` is folded as node() folds it, which narrows s: only for a
        schema that is then generated from, never for one whose language is reasoned about."""
        try:
            s = self.deref(s, ())
            while isinstance(s, dict) and "allOf" in s and hops < 8:
                merged = {k: v for k, v in s.items() if k != "allOf"}
                for b in s["allOf"]:
                    merged = self.merge(merged, self.deref(b, ()))
                s = self.deref(merged, ())
                hops += 1
            if fold and isinstance(s, dict) and "not" in s and not self.only_literals(s):
                try:
                    s = self.fold_not(s)
                except GrammarCompileError:
                    pass  # reasoned about without its `not` (which only narrows it)
        except (GrammarCompileError, RecursionError):
            return None
        return None if isinstance(s, dict) and "allOf" in s else s

    def excludes(self, a, b, hops: int = 0) -> bool:
        """True when no value generated for schema `a` is valid under schema `b` (sound, not
        complete: False means 'not shown')."""
        if hops > 6:
            return False
        check_deadline(self.deadline)
        fa, fb = self.flat(a), self.flat(b)
        if fa is False or fb is False:
            return True
        if fa is None or fb is None or fb is True or fb == {}:
            return False
        if fa is True:
            fa = {}
        shared = self.out_types(fa) & self.lang_types(fb)
        if not shared:
            return True
        lits = self.literal_values(fa)
        if lits is not None:
            return not any(self.valid_under(x, b) for x in lits)
        for key in ("anyOf", "oneOf"):
            if key in fa:  # a generates from its branches (with its other keywords merged in)
                subs = self.branch_schemas(fa, key)
                return subs is not None and all(self.excludes(x, b, hops + 1) for x in subs)
            if key in fb:  # an instance of b is an instance of one of its branches
                subs = self.branch_schemas(fb, key)
                return subs is not None and all(self.excludes(fa, x, hops + 1) for x in subs)
        if shared <= {"integer", "number"} and self.ranges_disjoint(fa, fb):
            return True
        if shared == {"string"} and isinstance(fa.get("pattern"), str) and isinstance(fb.get("pattern"), str):
            pa, pb = _anchored_prefix(fa["pattern"]), _anchored_prefix(fb["pattern"])
            if not (pa.startswith(pb) or pb.startswith(pa)):
                return True  # every string of a starts with pa, every string of b with pb
        if shared == {"object"}:
            return self.objects_exclude(fa, fb, hops)
        return False

    def objects_exclude(self, a: dict, b: dict, hops: int) -> bool:
        """Objects generated for `a` (declared and required properties only) fail `b`: b requires a
        property a never generates, b is closed and a always generates one it does not declare,
        or a always generates one whose value b's schema for it rejects."""
        props_a = a.get("properties") or {}
        req_a = set(_required(a))
        addl_a = a.get("additionalProperties", True)
        free = not props_a and not req_a and (addl_a is not False or a.get("patternProperties"))
        deps = DEPENDENCY_KEYWORDS & a.keys()
        keys_a = None if free or deps else {k for k, v in props_a.items() if v is not False} | req_a
        if any(props_a.get(k) is False for k in req_a):
            return True  # a generates no object at all
        props_b = b.get("properties") or {}
        if keys_a is not None and set(_required(b)) - keys_a:
            return True
        if b.get("additionalProperties", True) is False and not b.get("patternProperties") and req_a - set(props_b):
            return True
        for k in req_a & set(props_b):
            sa = props_a.get(k, addl_a if isinstance(addl_a, dict) else {})
            if self.excludes(sa, props_b[k], hops + 1):
                return True
        return False

    def narrow(self, a, b):
        """A subset of schema `a` that overlaps less with schema `b`, or None (see exclusive)."""
        if not isinstance(a, dict):
            return None
        lits = self.literal_values(a)
        if lits is not None:
            keep = [x for x in lits if not self.valid_under(x, b)]
            return {**{k: v for k, v in a.items() if k not in ("const", "enum")}, "enum": keep}
        if not isinstance(b, dict) or "anyOf" in a or "oneOf" in a or "object" not in self.out_types(a):
            return None
        props = a.get("properties") or {}
        req = _required(a)
        optional = [k for k, v in props.items() if k not in req and v is not False]
        props_b = b.get("properties") or {}
        closed_b = b.get("additionalProperties", True) is False and not b.get("patternProperties")
        for k in optional:  # require a property whose value b cannot accept
            if (closed_b and k not in props_b) or (k in props_b and self.excludes(props[k], props_b[k])):
                return {**a, "required": req + [k]}
        for k in _required(b):  # forbid an optional property b requires
            if k in optional:
                return {**a, "properties": {**props, k: False}}
        return None

    def branch_schemas(self, s: dict, key: str):
        rest = {k: v for k, v in s.items() if k != key and k not in ANNOTATIONS}
        try:
            return [self.merge(dict(rest), self.deref(x, ())) if rest else x for x in s[key]]
        except GrammarCompileError:
            return None

    def out_types(self, s) -> set:
        """The JSON types node() can generate for a flat schema (number includes integer)."""
        if s is True or s == {}:
            return set(ALL_TYPES)
        if not isinstance(s, dict):
            return set()
        lits = self.literal_values(s)
        if lits is not None and not ({"anyOf", "oneOf"} & s.keys()):
            return set().union(*[_literal_types(v) for v in lits])
        for key in ("anyOf", "oneOf"):
            if key in s:
                subs = self.branch_schemas(s, key)
                if subs is None:
                    return set(ALL_TYPES)
                return set().union(*[self.out_types(self.flat(x)) if self.flat(x) is not None else set(ALL_TYPES)
                                     for x in subs])
        types = self.implied_types(s)
        return _widen(set(types) if types is not None else set(ALL_TYPES))

    def lang_types(self, s) -> set:
        """The JSON types of the instances valid under a flat schema, over-approximated."""
        if s is False:
            return set()
        if not isinstance(s, dict):
            return set(ALL_TYPES)
        ts = set(ALL_TYPES)
        if "type" in s:
            ts &= _widen({s["type"]} if isinstance(s["type"], str) else set(s["type"]))
        lits = self.literal_values(s)
        if lits is not None:
            ts &= set().union(*[_literal_types(v) for v in lits])
        for key in ("anyOf", "oneOf"):
            if key in s and isinstance(s[key], list):
                u = set()
                for x in s[key]:
                    fx = self.flat(x)
                    u |= self.lang_types(fx) if fx is not None else set(ALL_TYPES)
                ts &= u
        return ts

    @staticmethod
    def literal_values(s):
        if isinstance(s, dict):
            if "const" in s:
                return [s["const"]]
            if "enum" in s and isinstance(s["enum"], list):
                return list(s["enum"])
        return None

    def valid_under(self, x, schema, unsure: bool = True) -> bool:
        """jsonschema's verdict for instance x under a subschema of the root (`unsure` when it
        cannot tell, e.g. an unresolvable $ref)."""
        from jsonschema.validators import validator_for

        try:
            if self._validator is None:
                self._validator = validator_for(self.root)(self.root)
            return self._validator.evolve(schema=schema).is_valid(x)
        except Exception:
            return unsure

    def ranges_disjoint(self, a: dict, b: dict) -> bool:
        try:
            lo_a, lo_ax, hi_a, hi_ax = self.bounds(a)
            lo_b, lo_bx, hi_b, hi_bx = self.bounds(b)
        except GrammarCompileError:
            return False

        def below(hi, hi_x, lo, lo_x):
            return hi is not None and lo is not None and (hi < lo or (hi == lo and (hi_x or lo_x)))

        return below(hi_a, hi_ax, lo_b, lo_bx) or below(hi_b, hi_bx, lo_a, lo_ax)

    def merge(self, a, b):
        """Conjunction of two schemas as one schema, for allOf / siblings; refuses what it
        cannot express."""
        if b is True or b == {}:
            return a
        if a is True or a == {}:
            return b
        if a is False or b is False:
            return False
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise GrammarCompileError("json: 'allOf' with a non-object schema is not supported")
        out = dict(a)
        for k, v in b.items():
            if k in ANNOTATIONS:
                out.setdefault(k, v)
                continue
            if k not in out or _same(out[k], v):
                out[k] = v
            elif k == "properties":
                props = dict(out[k])
                for name, sub in v.items():
                    props[name] = self.merge(props[name], sub) if name in props else sub
                out[k] = props
            elif k == "required":
                out[k] = list(dict.fromkeys(list(out[k]) + list(v)))
            elif k == "type":
                ta = {out[k]} if isinstance(out[k], str) else set(out[k])
                tb = {v} if isinstance(v, str) else set(v)
                both = (ta & tb) | ({"integer"} if ("integer" in ta and "number" in tb) or ("number" in ta and "integer" in tb) else set())
                if not both:
                    return False
                out[k] = sorted(both)
            elif k in ("minimum", "minLength", "minItems", "minProperties"):
                out[k] = max(out[k], v)
            elif k in ("maximum", "maxLength", "maxItems", "maxProperties"):
                out[k] = min(out[k], v)
            elif k == "enum":
                out[k] = [x for x in out[k] if any(_same(x, y) for y in v)]
            elif k in ("allOf",):
                out[k] = list(out[k]) + list(v)
            elif k == "items" and isinstance(v, dict) and isinstance(out[k], dict):
                out[k] = self.merge(out[k], v)
            elif k == "additionalProperties" and isinstance(v, (dict, bool)) and isinstance(out[k], (dict, bool)):
                out[k] = self.merge(out[k], v)
            elif k in ("anyOf", "oneOf"):
                # (exactly) one of A and one of B == (exactly) one of the pairs
                if len(out[k]) * len(v) > 64:
                    raise GrammarCompileError(f"json: 'allOf' of two '{k}' with {len(out[k])} x {len(v)} branches is too large")
                out[k] = [{"allOf": [x, y]} for x in out[k] for y in v]
            else:
                raise GrammarCompileError(f"json: cannot merge keyword {k!r} across 'allOf' branches")
        # one branch's additionalProperties governs the properties only the other declares
        for x, y in ((a, b), (b, a)):
            extra = [n for n, v in y.get("properties", {}).items() if n not in x.get("properties", {}) and v is not False]
            addl = x.get("additionalProperties", True)
            if extra and addl is False:
                raise GrammarCompileError("json: 'allOf' branches where one has additionalProperties false "
                                          f"and the other adds properties {sorted(extra)} are not supported")
            if extra and isinstance(addl, dict) and addl:
                out["properties"] = {**out["properties"], **{n: self.merge(out["properties"][n], addl) for n in extra}}
        return out

    # -- literals --

    def literals(self, s: dict):
        vals = [s["const"]] if "const" in s else list(s["enum"])
        if "const" in s and "enum" in s:
            vals = [v for v in vals if any(_same(v, y) for y in s["enum"])]
        rest = {k: v for k, v in s.items() if k not in ("enum", "const") and k not in ANNOTATIONS}
        if rest:
            from jsonschema.validators import validator_for

            probe = dict(rest)
            for k in ("definitions", "$defs"):
                if k in self.root:
                    probe[k] = self.root[k]
            try:
                v = validator_for(self.root)(probe)
                vals = [x for x in vals if v.is_valid(x)]
            except Exception as e:
                raise GrammarCompileError(f"json: cannot check enum/const against sibling keywords: {e}") from None
        return alt(*[json_literal(v) for v in vals])

    # -- scalars --

    def string(self, s: dict):
        bounds = _count_bounds(s, "minLength", "maxLength", MAX_STRING_LENGTH)
        if bounds is None:
            return NEVER
        lo, hi = bounds
        fmt = s.get("format")
        pattern = s.get("pattern")
        fmt_re = None
        if fmt is not None:
            if fmt in FORMATS:
                fmt_re = FORMATS[fmt]
            elif fmt in KNOWN_UNSUPPORTED_FORMATS:
                raise GrammarCompileError(f"json: format {fmt!r} is not supported")
        if pattern is None and fmt_re is None:
            if hi is None and lo == 0:
                return STRING
            # Counted strings use unescaped characters only: a counter over the escape-aware
            # unit multiplies the DFA by its ~20 states (sound: a subset of the valid strings).
            return seq('"', rep(SAFE_CHAR, lo, hi), '"')
        if pattern is None and lo == 0 and hi is None:
            return seq('"', fmt_re, '"')
        # The pattern (search semantics), the format and the length, over characters that need
        # no escape; more than one of them is an intersection of DFAs.
        parts = []
        if pattern is not None:
            if not isinstance(pattern, str):
                raise GrammarCompileError("json: 'pattern' must be a string")
            try:
                parts.append(R.search(R.parse(pattern), SAFE_SET))
            except GrammarCompileError as e:
                raise GrammarCompileError(f"json: pattern {pattern!r}: {str(e).removeprefix('regex: ')}") from None
        if fmt_re is not None:
            parts.append(_n(fmt_re))
        if lo or hi is not None:
            parts.append(rep(SAFE_CHAR, lo, hi))
        body = parts[0]
        if len(parts) > 1:
            try:
                dfa = compile_node(parts[0], self.deadline)
                for p in parts[1:]:
                    dfa = intersect(dfa, compile_node(p, self.deadline), self.deadline)
            except GrammarCompileError as e:
                if "accepts no string" in str(e):
                    return NEVER
                raise
            body = ("d", dfa)
        return seq('"', body, '"')

    def bounds(self, s: dict):
        lo, lo_excl, hi, hi_excl = s.get("minimum"), False, s.get("maximum"), False
        emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
        if emin is True:
            lo_excl = True
        elif isinstance(emin, (int, float)) and not isinstance(emin, bool):
            if lo is None or emin >= lo:
                lo, lo_excl = emin, True
        if emax is True:
            hi_excl = True
        elif isinstance(emax, (int, float)) and not isinstance(emax, bool):
            if hi is None or emax <= hi:
                hi, hi_excl = emax, True
        for v in (lo, hi):
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
                raise GrammarCompileError(f"json: numeric bound {v!r} is not a finite number")
        return lo, lo_excl, hi, hi_excl

    def multiples(self, s: dict, integer: bool):
        """multipleOf other than 1: the first MAX_MULTIPLES multiples from the lower bound (or 0,
        or down from the upper bound), each kept only if a validator agrees (for a fractional
        step jsonschema divides floats, so 0.07 is not a multiple of 0.01 there)."""
        from decimal import Decimal

        mult = s["multipleOf"]
        if isinstance(mult, bool) or not isinstance(mult, (int, float)) or not math.isfinite(mult) or mult <= 0:
            raise GrammarCompileError(f"json: keyword 'multipleOf' ({mult!r}) must be a positive number")
        lo, _, hi, _ = self.bounds(s)
        step = Decimal(repr(mult))
        if lo is not None:
            first = math.ceil(Decimal(repr(lo)) / step)
        elif hi is not None:
            first = math.floor(Decimal(repr(hi)) / step) - MAX_MULTIPLES + 1
        else:
            first = 0
        check = {k: v for k, v in s.items() if k in TYPE_KEYWORDS["number"]}
        if integer:
            check["type"] = "integer"
        vals = []
        for m in range(first, first + MAX_MULTIPLES):
            d = step * m
            v = int(d) if d == d.to_integral_value() else float(d)
            if self.valid_under(v, check, unsure=False):
                vals.append(v)
        if not vals:
            raise GrammarCompileError(f"json: keyword 'multipleOf' ({mult}): no multiple found in the bounds")
        return alt(*[json_literal(v) for v in vals])

    def integer(self, s: dict):
        mult = s.get("multipleOf")
        if mult is not None and not (isinstance(mult, (int, float)) and float(mult) == 1.0):
            return self.multiples(s, integer=True)
        lo, lo_excl, hi, hi_excl = self.bounds(s)
        if lo is None and hi is None:
            return INTEGER
        ilo = None if lo is None else (math.floor(lo) + 1 if lo_excl else math.ceil(lo))
        ihi = None if hi is None else (math.ceil(hi) - 1 if hi_excl else math.floor(hi))
        if ilo is not None and ihi is not None and ilo > ihi:
            return NEVER
        return signed_int_range(ilo, ihi)

    def number(self, s: dict):
        mult = s.get("multipleOf")
        if mult is not None:
            if isinstance(mult, (int, float)) and float(mult) == 1.0:
                return self.integer({k: v for k, v in s.items() if k != "multipleOf"})
            return self.multiples(s, integer=False)
        lo, lo_excl, hi, hi_excl = self.bounds(s)
        if lo is None and hi is None:
            return NUMBER
        # a fractional bound is tightened inwards to an integer (a subset of the interval)
        if lo is not None and float(lo) != int(lo):
            lo, lo_excl = math.ceil(lo), False
        if hi is not None and float(hi) != int(hi):
            hi, hi_excl = math.floor(hi), False
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_excl or hi_excl))):
            raise GrammarCompileError(f"json: fractional bounds 'minimum'/'maximum' {s.get('minimum')}..{s.get('maximum')} "
                                      "with no integer between them are not supported")
        return number_range(None if lo is None else int(lo), lo_excl, None if hi is None else int(hi), hi_excl)

    # -- containers --

    def any_value(self, depth: int):
        """Any JSON value nesting at most `depth` containers deep."""
        scalars = "(?:" + "|".join([STRING, NUMBER, "true", "false", "null"]) + ")"
        if depth <= 0:
            return scalars
        return _any_value_dfa(scalars, self.lbrace, self.rbrace, self.lbracket, self.rbracket, self.colon, self.comma, depth)

    def object(self, s: dict, refs: tuple, depth: int):
        props: dict = dict(s.get("properties", {}) or {})
        required = list(s.get("required", []) or [])
        addl = s.get("additionalProperties", True)
        if "unevaluatedProperties" in s and addl is True:
            addl = s["unevaluatedProperties"]
        for name in required:
            if name not in props:
                if addl is False:
                    return NEVER
                props[name] = addl if isinstance(addl, dict) else {}
        min_p, max_p = s.get("minProperties", 0), s.get("maxProperties")
        pattern_props = s.get("patternProperties", {}) or {}
        names = s.get("propertyNames")
        if not props and (addl is not False or pattern_props):
            return self.free_object(s, addl, refs, depth)
        for pat in pattern_props:
            try:
                hit = [n for n in props if re.search(pat, n)]
            except re.error:
                raise GrammarCompileError(f"json: patternProperties pattern {pat!r} is invalid") from None
            for n in hit:  # a declared property whose name matches is bound by both schemas
                props[n] = self.merge(self.deref(props[n], refs), self.deref(pattern_props[pat], refs))
        if names not in (None, True, {}):
            bad = [n for n in props if not self.valid_under(n, names, unsure=False)]
            if any(n in required for n in bad):
                return NEVER
            for n in bad:
                props.pop(n)
        items = []
        for name, sub in props.items():
            val = self.node(sub, refs, depth - 1 if sub in (True, {}) else depth)
            req = name in required
            if val is NEVER:
                if req:
                    return NEVER
                continue
            items.append([seq(json_literal(name), self.colon, val), req])
        # min/maxProperties: generate a fixed subset of the counts (declared order decides which
        # optional properties become required, or are left out)
        n_req = sum(r for _, r in items)
        if len(items) < min_p or (max_p is not None and n_req > max_p):
            return NEVER
        for it in items:
            if n_req >= min_p:
                break
            if not it[1]:
                it[1], n_req = True, n_req + 1
        if max_p is not None and len(items) > max_p:
            room = max_p - n_req
            keep = []
            for it in items:
                if it[1] or room > 0:
                    room -= not it[1]
                    keep.append(it)
            items = keep
        return seq(self.lbrace, self.members([tuple(it) for it in items]), self.rbrace)

    def free_object(self, s: dict, addl, refs: tuple, depth: int):
        """An object without declared properties: keys from patternProperties (values under every
        pattern's schema, since a key may match several) or else any key allowed by propertyNames,
        with additionalProperties' values."""
        min_p, max_p = s.get("minProperties", 0), s.get("maxProperties")
        if min_p > 1:  # two generated keys may be equal, and a repeated key counts once
            raise GrammarCompileError(f"json: keyword 'minProperties' ({min_p}) on an object without declared properties "
                                      "is not supported")
        names = s.get("propertyNames")
        names = {} if names in (None, True) else names
        key_schema = self.merge({"type": "string"}, names)
        pattern_props = s.get("patternProperties", {}) or {}
        if pattern_props:
            key = alt(*[self.node(self.merge(key_schema, {"pattern": p}), refs, depth) for p in pattern_props])
            value_schema = True
            for sub in pattern_props.values():
                value_schema = self.merge(value_schema, self.deref(sub, refs))
        else:
            key = self.node(key_schema, refs, depth)
            value_schema = addl if isinstance(addl, dict) and addl else True
        val = NEVER if value_schema is False else (
            self.any_value(depth - 1) if value_schema in (True, {}) else self.node(value_schema, refs, depth - 1))
        pair = seq(key, self.colon, val)
        if max_p == 0 or pair is NEVER:
            return NEVER if min_p else self.lbrace + self.rbrace
        more = seq(pair, rep(seq(self.comma, pair), 0, None if max_p is None else max_p - 1))
        return seq(self.lbrace, more if min_p else opt(more), self.rbrace)

    def fold_not(self, schema: dict):
        """`not` as a restriction of the rest of the schema: dropped when nothing the rest generates
        can match it; `not: {}` is false; `not: {type: T}` removes types; `not: {required: R}`
        forbids one property of R (and non-objects, which satisfy any `required`)."""
        self._not_depth += 1
        try:
            if self._not_depth > 16:
                raise GrammarCompileError("json: keyword 'not' nested too deeply (or recursive)")
            return self._fold_not(schema)
        finally:
            self._not_depth -= 1

    def _fold_not(self, schema: dict):
        rest = {k: v for k, v in schema.items() if k != "not"}
        neg = self.flat(schema["not"])
        if neg is False:
            return rest
        if neg is True or neg == {}:
            return False
        if self.excludes(rest, schema["not"]):
            return rest
        keys = set(neg) - ANNOTATIONS if isinstance(neg, dict) else set()
        if keys == {"type"}:
            drop = _widen({neg["type"]} if isinstance(neg["type"], str) else set(neg["type"]))
            if "integer" in drop:  # numbers that are not integers cannot be generated alone
                drop.add("number")
            return self.merge(rest, {"type": [t for t in ALL_TYPES if t not in drop]})
        if keys and keys <= {"type", "required", "properties"} and neg.get("type", "object") in ("object", ["object"]):
            # an object fails `neg` if it lacks one required property or one property's value
            # fails; a non-object fails it only through `type`
            obj = {} if "type" in neg else {"type": "object"}
            flat = self.flat(rest)
            flat = flat if isinstance(flat, dict) else {}
            if isinstance(neg.get("required"), list) and neg["required"]:
                req = _required(flat)
                k = next((n for n in neg["required"] if n not in req), neg["required"][0])
                return self.merge(rest, {**obj, "properties": {k: False}})
            for k, sub in (neg.get("properties") or {}).items():
                cur = (flat.get("properties") or {}).get(k, {})
                val = {**(cur if isinstance(cur, dict) else {}), "not": sub}
                try:
                    val = val if self.only_literals(val) else self.fold_not(val)
                    return self.merge(rest, {**obj, "required": [k], "properties": {k: val}})
                except GrammarCompileError:
                    continue
        raise GrammarCompileError("json: keyword 'not' is not supported here (only 'not' of {}, a type, a "
                                  "required list, or of what the rest of the schema already excludes)")

    def fold_conditional(self, schema: dict):
        """if/then/else as anyOf[rest+if+then, rest+else+not(if)], keeping the branches that
        can be enforced (then/else alone, without if, are ignored as validators ignore them)."""
        rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
        if "if" not in schema or not ({"then", "else"} & schema.keys()):
            return rest
        cond, then, other = schema["if"], schema.get("then", True), schema.get("else", True)
        branches = []
        for parts in ((cond, then), ({"not": cond}, other)):
            try:
                b = rest
                for p in parts:
                    b = self.merge(b, self.deref(p, ()))
                    if isinstance(b, dict) and "not" in b and not self.only_literals(b):
                        b = self.fold_not(b)
                branches.append(b)
            except GrammarCompileError:
                continue
        if not branches:
            raise GrammarCompileError("json: keyword 'if' with 'then'/'else' that cannot be enforced is not supported")
        return {"anyOf": branches}

    def fold_dependencies(self, s: dict):
        """dependencies / dependentRequired / dependentSchemas, enforced by requiring each one
        whose property may be generated of every instance (a subset: if the property is present
        the dependency holds); those whose property is never generated drop out."""
        pending: dict = {}
        for key in DEPENDENCY_KEYWORDS:
            deps = s.get(key) or {}
            if not isinstance(deps, dict):
                raise GrammarCompileError(f"json: keyword {key!r} must be an object")
            for k, v in deps.items():
                pending.setdefault(k, []).append({"required": v} if isinstance(v, list) else v)
        out = {k: v for k, v in s.items() if k not in DEPENDENCY_KEYWORDS}
        for _ in range(16):
            if out is False:
                return False
            props = out.get("properties") or {}
            req = out.get("required") or []
            opaque = bool(COMBINATORS & out.keys()) or (not props and not req)  # keys not known here
            fire = [k for k in pending if opaque or k in req or props.get(k, False) is not False]
            if not fire:
                return out
            for k in fire:
                for dep in pending.pop(k):
                    out = self.merge(out, dep)
            if isinstance(out, dict) and DEPENDENCY_KEYWORDS & out.keys():
                return self.fold_dependencies(out)  # a dependency schema brought its own
        raise GrammarCompileError("json: keyword 'dependencies' chains too long")

    def members(self, items: list):
        if not items:
            return ""
        first_req = next((i for i, (_, r) in enumerate(items) if r), None)
        if first_req is not None:
            parts = [opt(seq(p, self.comma)) for p, _ in items[:first_req]]
            parts.append(items[first_req][0])
            for p, r in items[first_req + 1 :]:
                parts.append(seq(self.comma, p) if r else opt(seq(self.comma, p)))
            return seq(*parts)
        if len(items) > 24:
            raise GrammarCompileError(f"json: an object with {len(items)} properties and none required is too large")
        # none required: which one comes first decides where the commas go
        tails = [""] * (len(items) + 1)
        for i in range(len(items) - 1, -1, -1):
            tails[i] = seq(opt(seq(self.comma, items[i][0])), tails[i + 1])
        return opt(alt(*[seq(items[i][0], tails[i + 1]) for i in range(len(items))]))

    def array(self, s: dict, refs: tuple, depth: int):
        bounds = _count_bounds(s, "minItems", "maxItems", MAX_ITEMS)
        if bounds is None:
            return NEVER
        lo, hi = bounds
        if s.get("uniqueItems") is True and (hi is None or hi > 1):
            raise GrammarCompileError("json: keyword 'uniqueItems' is not supported")
        items = s.get("items", True)
        prefix = s.get("prefixItems")
        if isinstance(items, list):  # draft 4-2019 tuple form
            prefix, rest = items, s.get("additionalItems", True)
        else:
            rest = items
        if "unevaluatedItems" in s and rest is True and prefix is None:
            rest = s["unevaluatedItems"]
        prefix = prefix or []
        slots = [self.node(p, refs, depth - 1 if p in (True, {}) else depth) for p in prefix]
        if rest is True or rest == {}:
            rest_val = self.any_value(depth - 1)
        else:
            rest_val = self.node(rest, refs, depth)
        if prefix and lo <= len(prefix):
            rest_val = NEVER  # we do not generate items past the tuple unless required to
        n_max = hi
        # item k (0-based) is slots[k] or rest_val; items from lo on are optional.
        if rest_val is NEVER:
            n_max = len(slots) if hi is None else min(hi, len(slots))
        if lo > (n_max if n_max is not None else lo):
            return NEVER
        if not slots:
            if lo == 0:
                body = opt(seq(rest_val, rep(seq(self.comma, rest_val), 0, None if hi is None else hi - 1)))
            else:
                body = seq(rest_val, rep(seq(self.comma, rest_val), lo - 1, None if hi is None else hi - 1))
            return seq(self.lbracket, body, self.rbracket)

        def item(k):
            return slots[k] if k < len(slots) else rest_val

        # build from the end: tail(k) = what may follow after k items
        if n_max is None:
            tail = rep(seq(self.comma, rest_val), max(0, lo - len(slots)), None)
            k = len(slots)
        else:
            tail = ""
            k = n_max
        while k > 0:
            k -= 1
            piece = seq(item(k), tail)
            if k > 0:
                piece = seq(self.comma, piece)
            tail = piece if k < lo else opt(piece)
            if tail is NEVER:
                return NEVER
        return seq(self.lbracket, tail, self.rbracket)


@functools.lru_cache(maxsize=32)
def _any_value_dfa(scalars, lbrace, rbrace, lbracket, rbracket, colon, comma, depth):
    """Built level by level as minimal DFAs (the regex would repeat the inner value 4x per
    level); cached per whitespace policy and depth."""
    if depth <= 0:
        return ("d", compile_node(_n(scalars)))
    inner = _any_value_dfa(scalars, lbrace, rbrace, lbracket, rbracket, colon, comma, depth - 1)
    pair = seq(STRING + colon, inner)
    obj = seq(lbrace, opt(seq(pair, rep(seq(comma, pair), 0, None))), rbrace)
    arr = seq(lbracket, opt(seq(inner, rep(seq(comma, inner), 0, None))), rbracket)
    return ("d", compile_node(alt(scalars, obj, arr)))


def _required(s: dict) -> list:
    r = s.get("required")
    return [n for n in r if isinstance(n, str)] if isinstance(r, list) else []


def _anchored_prefix(pattern: str) -> str:
    """The literal text every match of a '^'-anchored pattern starts with ('' if unanchored)."""
    if not pattern.startswith("^") or "|" in pattern:
        return ""
    out, i = [], 1
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            c, i = pattern[i + 1], i + 1
        elif not (c.isalnum() or c in " -_/:,@#%&=~'\"<>!;`"):
            break
        if i + 1 < len(pattern) and pattern[i + 1] in "?*{":
            break
        out.append(c)
        if i + 1 < len(pattern) and pattern[i + 1] == "+":
            break
        i += 1
    return "".join(out)


def _same(a, b) -> bool:
    """JSON equality as validators see it: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _widen(types: set) -> set:
    """Every number type set includes integer (an integer is a number)."""
    return types | {"integer"} if "number" in types else types


def _literal_types(v) -> set:
    """The JSON types of a literal; a number counts as both (1.0 is an integer from draft 6 on)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return {"integer", "number"}
    return {_type_of(v)}


def _type_of(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v.is_integer() else "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"
