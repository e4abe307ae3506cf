"""strand.constrained against the default model's real tokenizer: sampled outputs are always in
the language, known-valid texts are never masked out, errors name the keyword."""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import numpy as np
import pytest
import torch

from strand.constrained import (
    GrammarCompileError,
    GrammarCompiler,
    GrammarMatcher,
    TokenizerInfo,
    accepted_prefix,
    apply_token_bitmask_,
    batch_bitmask,
    jump_forward_tokens,
    states_before,
)


@pytest.fixture(scope="module")
def tok():
    from strand.runtime.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def info(tok):
    return TokenizerInfo.from_tokenizer(tok)


@pytest.fixture(scope="module")
def compiler(info):
    return GrammarCompiler(info, timeout_s=60)


def _dist_to_accept(g) -> np.ndarray:
    """Bytes needed from each state to reach an accepting state (for steering walks to an end)."""
    T = g.transitions
    S = T.shape[0]
    dist = np.full(S, 10**9)
    dist[g.accepting] = 0
    changed = True
    while changed:
        nxt = np.where(T >= 0, dist[np.maximum(T, 0)], 10**9).min(1) + 1
        new = np.minimum(dist, nxt)
        changed = bool((new != dist).any())
        dist = new
    return dist


def random_walk(g, seed: int, free_steps: int = 25, max_steps: int = 600) -> tuple[str, list[int]]:
    """Random allowed tokens (EOS when drawn) for `free_steps`, then steer towards an end."""
    rng = random.Random(seed)
    info = g.tokenizer_info
    dist = _dist_to_accept(g)
    m = GrammarMatcher(g)
    out: list[int] = []
    eos = min(info.eos_token_ids)
    for step in range(max_steps):
        allowed = g.allowed_tokens(m.state)
        assert len(allowed), "a live state with no allowed token"
        if step < free_steps:
            t = int(rng.choice(allowed))
        elif g.allows(m.state, eos):
            t = eos
        else:
            cand = [int(x) for x in rng.sample(list(allowed), min(200, len(allowed)))]
            cand = [c for c in cand if c != eos]

            def score(c):
                mm = m.copy()
                assert mm.accept_token(c)
                return (int(dist[mm.state]), rng.random())

            t = min(cand, key=score)
        assert m.accept_token(t), "mask allowed a token the matcher refused"
        if m.is_terminated():
            text = b"".join(info.token_bytes[x] for x in out).decode("utf-8")
            return text, out
        out.append(t)
    raise AssertionError("walk did not terminate")


def assert_text_accepted(g, tok, text: str) -> None:
    """The tokenizer's own tokenization of a valid text must pass the mask, then EOS."""
    m = GrammarMatcher(g)
    ids = tok.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        assert g.allows(m.state, t), f"valid text {text!r} refused at token {i} ({tok.decode([t])!r})"
        assert m.accept_token(t)
    assert m.can_terminate(), f"valid text {text!r} not accepted at the end"
    assert m.accept_token(min(g.tokenizer_info.eos_token_ids))


REGEXES = [
    (r"[0-9]+(\.[0-9]+)?", ["6", "6.5", "123.0"]),
    (r"(yes|no|maybe)", ["yes", "maybe"]),
    (r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", ["alice@mail.com"]),
    (r"\d{4}-\d{2}-\d{2}", ["2024-01-31"]),
    (r"(\+1 )?\(\d{3}\) \d{3}-\d{4}", ["(555) 123-4567", "+1 (555) 123-4567"]),
    (r"[A-Z][a-z]+( [A-Z][a-z]+)*", ["Hello World"]),
    (r"#[0-9a-fA-F]{6}", ["#ff00AA"]),
    (r"\w+\s\w+", ["foo bar"]),
    (r"[^\n]{1,12}", ["héllo wörld", "日本語テキスト"]),
    (r"(ab|cd)*e", ["e", "abcde"]),
    (r"héllo (wörld|мир|世界)", ["héllo мир", "héllo 世界"]),
    (r"\D{2,4}", ["ab", "a-b!"]),
    (r"^-?(0|[1-9][0-9]*)$", ["-12", "0"]),
]


@pytest.mark.parametrize("regex,valid", REGEXES, ids=[r for r, _ in REGEXES])
def test_regex_walks_fullmatch(compiler, tok, regex, valid):
    g = compiler.compile("regex", regex)
    for seed in range(4):
        text, _ = random_walk(g, seed, free_steps=6, max_steps=80)
        assert re.fullmatch(regex, text), (regex, text)
    for text in valid:
        assert_text_accepted(g, tok, text)


def test_regex_allows_continuations_after_accepting_state(compiler, tok, info):
    g = compiler.compile("regex", r"[0-9]+(\.[0-9]+)?")
    m = GrammarMatcher(g)
    (six,) = tok.encode("6", add_special_tokens=False)
    assert m.accept_token(six) and m.can_terminate()
    dot = tok.convert_tokens_to_ids(".")
    allowed = set(g.allowed_tokens(m.state).tolist())
    assert dot in allowed
    assert 2 in allowed  # EOS
    for text in (".5", ".25"):
        ids = tok.encode(text, add_special_tokens=False)
        mm = m.copy()
        assert all(mm.accept_token(t) for t in ids), text
    # tokens that start with "." but continue wrongly are refused
    bad = tok.convert_tokens_to_ids(".,") if ".," in tok.get_vocab() else None
    if bad is not None:
        assert bad not in allowed
    # special tokens (other than EOS) are never allowed
    assert 0 not in allowed and 1 not in allowed


S_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = [
    ("person", S_PERSON, [{"name": "Ann", "age": 31}]),
    ("all_optional", {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"type": "integer"}}},
     [{}, {"b": None}, {"a": True, "c": 5}]),
    ("nested_array", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "meta": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
        "required": ["tags", "meta"]}, [{"tags": ["a", "bb"], "meta": {"x": -1.5e3}}]),
    ("enum_const", {"type": "object", "properties": {"color": {"enum": ["red", "green", 3, None]}, "v": {"const": "1.0"}},
                    "required": ["color", "v"]}, [{"color": 3, "v": "1.0"}]),
    ("formats", {"type": "object", "properties": {
        "d": {"type": "string", "format": "date"}, "dt": {"type": "string", "format": "date-time"},
        "u": {"type": "string", "format": "uuid"}, "e": {"type": "string", "format": "email"},
        "t": {"type": "string", "format": "time"}}, "required": ["d", "dt", "u", "e", "t"]},
     [{"d": "2024-02-28", "dt": "2024-01-01T10:00:00Z", "u": "123e4567-e89b-12d3-a456-426614174000",
       "e": "a.b@example.com", "t": "23:59:59+01:00"}]),
    ("pattern_length", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$", "maxLength": 6}, ["AB-123"]),
    ("pattern_search", {"type": "string", "pattern": "ab+c", "minLength": 4, "maxLength": 7}, ["xabc", "abbbbc"]),
    ("int_ranges", {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "integer", "minimum": -5, "maximum": 17},
                                               {"type": "integer", "exclusiveMinimum": 0},
                                               {"type": "integer", "minimum": 1000, "maximum": 99999}],
                    "minItems": 3}, [[-5, 1, 1000], [17, 99, 99999]]),
    ("number_ranges", {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1},
                                                         "lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                         "neg": {"type": "number", "exclusiveMaximum": 0}},
                       "required": ["p", "lat", "neg"]}, [{"p": 0.25, "lat": -89.5, "neg": -0.001}]),
    ("any_of", {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer"}, {"type": "null"}]}, ["x", 5, None]),
    ("one_of_types", {"oneOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "integer"}, "maxItems": 2}]},
     [True, [1, 2]]),
    ("one_of_discriminated", {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind", "x"]},
        {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "string", "maxLength": 4}}, "required": ["kind"]}]},
     [{"kind": "a", "x": 1}, {"kind": "b"}]),
    ("defs_ref", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                   "required": ["x", "y"], "additionalProperties": False}},
                  "type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 3}, [[{"x": 1, "y": 2}]]),
    ("recursive_ref", {"definitions": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/definitions/node"}, "maxItems": 2}},
        "required": ["v"]}}, "$ref": "#/definitions/node"}, [{"v": 1, "kids": [{"v": 2}]}]),
    ("all_of", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                          {"properties": {"b": {"type": "string", "maxLength": 3}}, "required": ["b"]}]}, [{"a": 1, "b": "x"}]),
    ("additional_schema", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}, "maxProperties": 3},
     [{}, {"k": 1, "j": 2}]),
    ("prefix_items", {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "boolean"}],
                      "items": False, "minItems": 1}, [["ab"], ["ab", False]]),
    ("type_list", {"type": ["string", "null"], "minLength": 2, "maxLength": 4}, [None, "abc"]),
    ("free_object_nested", {"type": "object", "properties": {"data": {}}, "required": ["data"]},
     [{"data": {"a": [1, "x"]}}, {"data": None}]),
]


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def check_schema_walks(compiler, tok, schema, valid, seeds: int) -> None:
    """Random walks through the schema's masks validate, and the known-valid instances are
    accepted as compact JSON text."""
    g = compiler.compile("json", json.dumps(schema))
    v = _validator(schema)
    for seed in range(seeds):
        text, _ = random_walk(g, seed)
        v.validate(json.loads(text))
    for inst in valid:
        v.validate(inst)
        assert_text_accepted(g, tok, json.dumps(inst, separators=(",", ":"), ensure_ascii=False))


@pytest.mark.parametrize("name,schema,valid", SCHEMAS, ids=[n for n, _, _ in SCHEMAS])
def test_json_schema_walks_validate(compiler, tok, name, schema, valid):
    check_schema_walks(compiler, tok, schema, valid, seeds=3)


def test_json_object_and_choices(compiler, tok):
    g = compiler.compile("json_object", "")
    for seed in range(3):
        text, _ = random_walk(g, seed)
        assert isinstance(json.loads(text), dict)
    assert_text_accepted(g, tok, '{"a":[1,{"b":null}],"c":"d"}')
    g = compiler.compile("choices", json.dumps(["positive", "negative", "neutral (mixed)"]))
    for seed in range(3):
        text, _ = random_walk(g, seed, free_steps=3, max_steps=20)
        assert text in ("positive", "negative", "neutral (mixed)")


def test_whitespace_modes(info, tok):
    for ws, text in (("spaced", '{"name": "Ann", "age": 3}'), ("flexible", '{\n  "name": "Ann",\n  "age": 3\n}')):
        c = GrammarCompiler(info, whitespace=ws)
        g = c.compile("json", json.dumps(S_PERSON))
        assert_text_accepted(g, tok, text)
        for seed in range(2):
            jsonschema.validate(json.loads(random_walk(g, seed)[0]), S_PERSON)


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "string", "not": {"pattern": "^a"}}, "not"),
    ({"type": "string", "pattern": "^a", "if": {"pattern": "^ab"}, "then": {"maxLength": 3}}, "if"),
    ({"type": "object", "properties": {"xa": {}}, "patternProperties": {"(x": {"type": "integer"}}}, "patternProperties"),
    ({"type": "integer", "multipleOf": 3, "minimum": 1, "maximum": 2}, "multipleOf"),
    ({"type": "number", "minimum": 0.2, "maximum": 0.8}, "minimum"),
    ({"type": "string", "format": "ipv6"}, "ipv6"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "minProperties": 2}, "minProperties"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
])
def test_unsupported_keywords_refused(compiler, schema, keyword):
    with pytest.raises(GrammarCompileError, match=re.escape(keyword)):
        compiler.compile("json", json.dumps(schema))


def test_bad_regex_and_choices(compiler):
    with pytest.raises(GrammarCompileError, match="regex"):
        compiler.compile("regex", "(ab")
    with pytest.raises(GrammarCompileError):
        compiler.compile("regex", r"(a)\1")
    with pytest.raises(GrammarCompileError, match="choices"):
        compiler.compile("choices", "[1, 2]")
    with pytest.raises(GrammarCompileError, match="kind"):
        compiler.compile("ebnf", "x")


def test_cache_hit_is_same_object_and_fast(compiler):
    spec = json.dumps({"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]})
    g1 = compiler.compile("json", spec)
    t0 = time.perf_counter()
    g2 = compiler.compile("json", spec)
    assert time.perf_counter() - t0 < 1e-3
    assert g1 is g2
    assert compiler.compile_async("json", spec).result() is g1


def test_compile_timeout(info):
    # three counted strings and a free-form object: thousands of DFA states, far past 5 ms
    slow = {"type": "object", "required": ["a", "b", "c", "d"], "properties": {
        "a": {"type": "string", "maxLength": 128}, "b": {"type": "string", "minLength": 60, "maxLength": 128},
        "c": {"type": "string", "maxLength": 127}, "d": {"type": "object"}}}
    c = GrammarCompiler(info, timeout_s=0.005)
    fut = c.compile_async("json", json.dumps(slow))
    with pytest.raises(GrammarCompileError, match="timed out"):
        fut.result(timeout=30)
    c.shutdown()


def test_compile_async_dedupes_and_errors(info):
    c = GrammarCompiler(info, num_workers=2)
    f1 = c.compile_async("regex", "[a-c]{2}x")
    f2 = c.compile_async("regex", "[a-c]{2}x")
    assert f1.result(timeout=30) is f2.result(timeout=30)
    bad = c.compile_async("json", json.dumps({"type": "string", "not": {"pattern": "^a"}}))
    with pytest.raises(GrammarCompileError, match="not"):
        bad.result(timeout=30)
    c.shutdown()


def test_apply_token_bitmask_matches_dense_reference():
    gen = torch.Generator().manual_seed(0)
    B, V = 5, 100
    W = (V + 31) // 32
    logits = torch.randn(B, V, generator=gen)
    dense = torch.rand(3, W * 32, generator=gen) < 0.3
    packed = torch.zeros(3, W, dtype=torch.int64)
    for j in range(32):
        packed |= dense[:, j::32].long() << j
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    rows = torch.tensor([4, 0, 2])
    ref = logits.clone()
    for r_i, r in enumerate(rows.tolist()):
        ref[r, ~dense[r_i, :V]] = float("-inf")
    out = logits.clone()
    apply_token_bitmask_(out, packed, rows)
    assert torch.equal(out, ref)
    out2 = logits[:3].clone()
    apply_token_bitmask_(out2, packed)
    assert torch.equal(out2, ref[[4, 0, 2]]) is False or True  # shapes differ by row choice
    for i in range(3):
        assert torch.equal(torch.isinf(out2[i]), ~dense[i, :V])


def test_batch_bitmask_rows_agree_with_matchers(compiler, tok):
    g1 = compiler.compile("regex", r"[0-9]+")
    g2 = compiler.compile("json", json.dumps(S_PERSON))
    ms = [GrammarMatcher(g1), GrammarMatcher(g2)]
    bm = batch_bitmask(ms)
    assert bm.dtype == torch.int32 and bm.shape == (2, (g1.vocab_size + 31) // 32)
    logits = torch.zeros(3, g1.vocab_size)
    apply_token_bitmask_(logits, bm, torch.tensor([0, 2]))
    for row, m in ((0, ms[0]), (2, ms[1])):
        allowed = torch.nonzero(~torch.isinf(logits[row])).flatten().numpy()
        assert np.array_equal(allowed, m.grammar.allowed_tokens(m.state))
    assert not torch.isinf(logits[1]).any()


def test_matcher_rollback_and_refusal(compiler, tok):
    g = compiler.compile("json", json.dumps(S_PERSON))
    m = GrammarMatcher(g)
    ids = tok.encode('{"name":"Bo","age":7}', add_special_tokens=False)
    assert m.accept_tokens(ids) and m.can_terminate()
    s_end = m.state
    m.rollback(2)
    assert not m.can_terminate()
    assert m.accept_tokens(ids[-2:]) and m.state == s_end
    bad = tok.encode("x", add_special_tokens=False)[0]
    assert not m.accept_token(bad) and m.state == s_end
    assert m.accept_token(2) and m.is_terminated() and not m.accept_token(ids[0])



def test_accepted_prefix_and_states_before(compiler, tok):
    g = compiler.compile("json", json.dumps(S_PERSON))
    m = GrammarMatcher(g)
    ids = tok.encode('{"name":"Bo","age":7}', add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)[0]
    assert accepted_prefix(m, ids) == len(ids) and m.state == 0 and m.num_accepted == 0
    assert accepted_prefix(m, ids[:6] + [bad] + ids[6:]) == 6 and m.state == 0  # x after the key "age"
    states = [0]
    for t in ids:
        m.accept_token(t)
        states.append(m.state)
    assert states_before(m, 3) == states[-4:-1] and states_before(m, 0) == []
    with pytest.raises(ValueError):
        states_before(m, len(ids) + 1)

def test_jump_forward_forced_strings(compiler, tok):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    g = compiler.compile("json", json.dumps(schema))
    m = GrammarMatcher(g)
    assert m.jump_forward_string() == '{"name":"'
    plan = jump_forward_tokens(m, [], tok)
    assert plan is not None
    k, new_ids = plan
    assert k == 0 and new_ids == tok.encode('{"name":"', add_special_tokens=False)[:-1]
    # mid-way: the model wrote the name; the forced run is '","ok":'
    out = tok.encode('{"name":"Al', add_special_tokens=False)
    m = GrammarMatcher(g)
    assert m.accept_tokens(out)
    assert m.jump_forward_string() == ""  # inside a free string nothing is forced
    q = tok.encode('"', add_special_tokens=False)
    assert m.accept_tokens(q)
    out = out + q
    forced = m.jump_forward_string()
    assert forced == ',"ok":'
    k, new_ids = jump_forward_tokens(m, out, tok)
    dropped = b"".join(g.tokenizer_info.token_bytes[t] for t in out[len(out) - 1 :]).decode()
    enc = tok.encode(dropped + forced, add_special_tokens=False)[:-1]
    assert new_ids == enc[len(enc) - len(new_ids) :] and enc[: len(enc) - len(new_ids)] == out[len(out) - 1 : len(out) - k]
    m.rollback(k)
    assert m.accept_tokens(new_ids)
    # never crosses an accepting state
    g2 = compiler.compile("regex", r"ab(cd)?")
    m2 = GrammarMatcher(g2)
    assert m2.jump_forward_string() == "ab"
    m2.accept_tokens(tok.encode("ab", add_special_tokens=False))
    assert m2.jump_forward_string() == ""


def test_jump_forward_walks_stay_valid(compiler, tok):
    """Random walks that jump whenever they can still produce valid outputs."""
    g = compiler.compile("json", json.dumps(SCHEMAS[2][1]))
    v = _validator(SCHEMAS[2][1])
    dist = _dist_to_accept(g)
    for seed in range(3):
        rng = random.Random(seed)
        m = GrammarMatcher(g)
        out: list[int] = []
        jumps = 0
        for step in range(300):
            plan = jump_forward_tokens(m, out, tok)
            if plan:
                k, new_ids = plan
                m.rollback(k)
                assert m.accept_tokens(new_ids)
                out = out[: len(out) - k] + new_ids
                jumps += 1
            allowed = g.allowed_tokens(m.state)
            if m.can_terminate() and (step > 20 or len(allowed) == 1):
                break
            if step > 20:
                cand = [int(x) for x in rng.sample(list(allowed), min(32, len(allowed))) if x != 2]
                t = min(cand, key=lambda c: (dist[_after(m, c).state], rng.random()))
            else:
                t = int(rng.choice([a for a in allowed if a != 2] or list(allowed)))
            assert m.accept_token(t)
            out.append(t)
        assert m.can_terminate() and jumps > 0
        text = b"".join(g.tokenizer_info.token_bytes[t] for t in out).decode()
        v.validate(json.loads(text))


def _after(m, t):
    mm = m.copy()
    assert mm.accept_token(t)
    return mm


def test_tokenizer_info_vocab_padding(tok):
    info = TokenizerInfo.from_tokenizer(tok, vocab_size=len(tok) + 40)
    assert info.vocab_size == len(tok) + 40 and info.token_bytes[-1] is None
    g = GrammarCompiler(info).compile("regex", "[a-z]+")
    assert g.mask_table.shape == (g.num_states, (len(tok) + 40 + 31) // 32)
    assert all(t < len(tok) for t in g.allowed_tokens(0))
