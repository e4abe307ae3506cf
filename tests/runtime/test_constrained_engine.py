"""Constrained decoding end to end on the default model: regex, JSON schema, jump-forward."""

import json
import re

import jsonschema
import pytest

from strand.runtime.errors import InvalidRequestError
from strand.runtime.tokenizer import apply_chat_template
from tests.test_constrained_grammar import REGEXES, SCHEMAS, _validator

REGEX_SPECS = [r for r, _ in REGEXES][:10]
SCHEMA_SPECS = [(n, s) for n, s, _ in SCHEMAS][:15]


def prompt(engine, what: str) -> str:
    return apply_chat_template(engine.tokenizer, [{"role": "user", "content": what}])


@pytest.fixture
def jump_forward(default_engine):
    """Flip jump-forward on the shared engine for one test (the server argument, read each step)."""
    args = default_engine.scheduler.args
    old = args.disable_jump_forward

    def set_(on: bool):
        args.disable_jump_forward = not on
    yield set_
    args.disable_jump_forward = old


def run_all(engine, specs, sp_extra, seeds):
    prompts, params, meta = [], [], []
    for kind, spec in specs:
        for seed in seeds:
            prompts.append(prompt(engine, "Answer with a JSON value." if kind == "json" else "Answer briefly."))
            sp = {"temperature": 1.0, "max_new_tokens": 96, "seed": seed, **sp_extra}
            sp["json_schema" if kind == "json" else "regex"] = json.dumps(spec) if kind == "json" else spec
            params.append(sp)
            meta.append((kind, spec))
    return zip(meta, engine.generate(prompt=prompts, sampling_params=params))


@pytest.mark.parametrize("jf", [True, False], ids=["jump-forward", "no-jump-forward"])
def test_sampled_outputs_obey_regex_and_schema(default_engine, jump_forward, jf):
    jump_forward(jf)
    specs = [("regex", r) for r in REGEX_SPECS] + [("json", s) for _, s in SCHEMA_SPECS]
    finished = 0
    for (kind, spec), out in run_all(default_engine, specs, {}, seeds=[1, 2]):
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] in ("stop", "length"), reason
        if reason["type"] == "length":
            continue  # cut off by max_new_tokens: a prefix of a valid output, said so
        finished += 1
        if kind == "regex":
            assert re.fullmatch(spec, out["text"]), (spec, out["text"])
        else:
            _validator(spec).validate(json.loads(out["text"]))
    assert finished >= 0.6 * len(specs) * 2  # free-running regexes at T=1 may hit the limit


def test_greedy_json_identical_with_and_without_jump_forward(default_engine, jump_forward):
    specs = [("json", s) for _, s in SCHEMA_SPECS]
    s = default_engine.scheduler
    runs = {}
    for jf in (False, True):
        jump_forward(jf)
        before = s.stats["num_forward_passes"], s.stats["jump_forward_tokens"]
        outs = [default_engine.generate(prompt=prompt(default_engine, "Answer with a JSON value."),
                                        sampling_params={"temperature": 0, "max_new_tokens": 64,
                                                         "json_schema": json.dumps(spec)})
                for _, spec in specs]
        runs[jf] = (outs, s.stats["num_forward_passes"] - before[0], s.stats["jump_forward_tokens"] - before[1])
    (off, passes_off, _), (on, passes_on, jumped) = runs[False], runs[True]
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    assert [o["meta_info"]["finish_reason"] for o in on] == [o["meta_info"]["finish_reason"] for o in off]
    assert jumped > 0 and passes_on < passes_off


def test_constrained_and_free_requests_share_a_batch(default_engine):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    p = prompt(default_engine, "What is 2 + 2?")
    params = [{"temperature": 0, "max_new_tokens": 30},
              {"temperature": 0, "max_new_tokens": 30, "json_schema": json.dumps(schema)},
              {"temperature": 0, "max_new_tokens": 30, "regex": r"(four|4)"},
              {"temperature": 0.8, "max_new_tokens": 30, "seed": 3}]
    free_alone = default_engine.generate(prompt=p, sampling_params=params[0])
    outs = default_engine.generate(prompt=[p] * 4, sampling_params=params)
    assert outs[0]["output_ids"] == free_alone["output_ids"]
    jsonschema.validate(json.loads(outs[1]["text"]), schema)
    assert outs[2]["text"] in ("four", "4")
    assert outs[3]["meta_info"]["finish_reason"] is not None


@pytest.mark.parametrize("params,needle", [
    ({"json_schema": json.dumps({"type": "array", "uniqueItems": True})}, "uniqueItems"),
    ({"json_schema": json.dumps({"type": "string", "not": {"pattern": "^a"}})}, "not"),
    ({"regex": "(unclosed"}, "regex"),
])
def test_uncompilable_specs_are_clear_errors(default_engine, params, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        default_engine.generate(prompt="hi", sampling_params={"max_new_tokens": 5, **params})
    ok = default_engine.generate(prompt="hi", sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert len(ok["output_ids"]) == 2


def test_jump_forward_keeps_logprobs_aligned(default_engine, jump_forward):
    jump_forward(True)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "zip": {"type": "integer"}}, "required": ["city", "zip"]}
    s = default_engine.scheduler
    before = s.stats["jump_forward_tokens"]
    out = default_engine.generate(prompt=prompt(default_engine, "Answer with a JSON value."),
                                  sampling_params={"temperature": 0, "max_new_tokens": 40,
                                                   "json_schema": json.dumps(schema)},
                                  return_logprob=True, top_logprobs_num=2)
    lps = out["meta_info"]["output_token_logprobs"]
    assert s.stats["jump_forward_tokens"] > before
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert len(out["meta_info"]["output_top_logprobs"]) == len(out["output_ids"])
    # greedy drafts are checked by the model, so every token has its real logprob
    assert all(lp is not None and lp <= 0 for lp, _, _ in lps)


def test_lookup_drafts_continue_the_latest_match():
    from strand.runtime.draft_lookup import lookup_drafts

    assert lookup_drafts([1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 2) == [[4, 1]] * 3  # latest match wins
    assert lookup_drafts([5, 6, 7, 5, 6], 4) == [[7, 5, 6, 7]] * 2  # reaches the end: repeats
    assert lookup_drafts([1, 2, 3], 4) == [] and lookup_drafts([1, 2, 3, 1], 0) == []
    assert lookup_drafts([8, 1, 9, 2, 1], 3) == [[9, 2, 1]]  # only the 1-gram occurs before


LONG_KEYS = {"type": "object", "properties": {
    "customer_account_identifier": {"type": "integer"},
    "shipping_destination_postcode": {"type": "string", "maxLength": 8},
    "preferred_delivery_window": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"earliest_hour_of_day": {"type": "integer"},
                                         "latest_hour_of_day": {"type": "integer"}},
        "required": ["earliest_hour_of_day", "latest_hour_of_day"]}}},
    "required": ["customer_account_identifier", "shipping_destination_postcode", "preferred_delivery_window"]}


@pytest.mark.parametrize("lookup", [False, True], ids=["forced-only", "with-lookup"])
def test_jump_forward_saves_passes_on_long_forced_keys(default_engine, jump_forward, lookup):
    s = default_engine.scheduler
    old = s.draft_lookup
    s.draft_lookup = lookup
    try:
        runs = {}
        for jf in (False, True):
            jump_forward(jf)
            before = s.stats["num_forward_passes"]
            out = default_engine.generate(prompt=prompt(default_engine, "Answer with a JSON value."),
                                          sampling_params={"temperature": 0, "max_new_tokens": 96,
                                                           "json_schema": json.dumps(LONG_KEYS)})
            runs[jf] = out, s.stats["num_forward_passes"] - before
    finally:
        s.draft_lookup = old
    (off, passes_off), (on, passes_on) = runs[False], runs[True]
    assert on["output_ids"] == off["output_ids"]
    assert passes_off == len(off["output_ids"])  # one pass per token without jump-forward
    assert passes_on <= (0.7 if lookup else 0.85) * passes_off, (passes_on, passes_off, off["text"])


def test_greedy_with_stop_string_identical_with_and_without_jump_forward(default_engine, jump_forward):
    outs = {}
    for jf in (False, True):
        jump_forward(jf)
        outs[jf] = default_engine.generate(prompt=prompt(default_engine, "Answer with a JSON value."),
                                           sampling_params={"temperature": 0, "max_new_tokens": 64, "stop": ["_hour"],
                                                            "json_schema": json.dumps(LONG_KEYS)})
    assert outs[True]["output_ids"] == outs[False]["output_ids"]
    assert outs[True]["meta_info"]["finish_reason"] == outs[False]["meta_info"]["finish_reason"]
