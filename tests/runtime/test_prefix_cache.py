"""The radix cache inside the Engine: reuse, correctness under eviction, namespaces, flush."""

import random

import pytest

from strand.runtime.engine import Engine
from strand.runtime.tokenizer import apply_chat_template

WORDS = ("alpha beta gamma delta river stone cloud paper light window garden music silver "
         "orange planet forest bridge engine copper winter").split()


def long_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def engines():
    on = Engine(dtype="float32")
    off = Engine(dtype="float32", disable_radix_cache=True)
    yield on, off
    on.shutdown()
    off.shutdown()


GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def chat(tok, system: str, user: str) -> str:
    return apply_chat_template(tok, [{"role": "system", "content": system}, {"role": "user", "content": user}])


def test_shared_prefix_is_reused_and_output_unchanged(engines):
    on, off = engines
    tok = on.tokenizer
    system = "Reference notes: " + long_text(500, seed=1)
    a, b = chat(tok, system, "Summarize in five words."), chat(tok, system, "Which word appears first?")
    ids_a, ids_b = tok.encode(a), tok.encode(b)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    assert shared >= 500
    on.flush_cache()
    first = on.generate(prompt=a, sampling_params=GREEDY)
    second = on.generate(prompt=b, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    # page size 1: everything shared is reusable (the last prompt token is always computed)
    assert second["meta_info"]["cached_tokens"] >= shared
    assert second["output_ids"] == off.generate(prompt=b, sampling_params=GREEDY)["output_ids"]
    again = on.generate(prompt=b, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(ids_b) - 1
    assert again["output_ids"] == second["output_ids"]


def test_multi_turn_chat_reuses_each_turn(engines):
    on, _ = engines
    tok = on.tokenizer
    on.flush_cache()
    messages = [{"role": "system", "content": "You are terse. " + long_text(60, seed=2)}]
    previous_len = 0
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: " + long_text(15, seed=10 + turn)})
        prompt = apply_chat_template(tok, messages)
        out = on.generate(prompt=prompt, sampling_params={"temperature": 0, "max_new_tokens": 10})
        if turn:
            # everything up to the previous turn's prompt + answer is cached
            assert out["meta_info"]["cached_tokens"] >= previous_len
        messages.append({"role": "assistant", "content": out["text"]})
        previous_len = out["meta_info"]["prompt_tokens"]


def test_eviction_under_memory_pressure_keeps_outputs_correct(engines):
    _, off = engines
    small = Engine(dtype="float32", max_total_tokens=450, chunked_prefill_size=128)
    tok = small.tokenizer
    prompts = [chat(tok, f"Context {k % 3}: " + long_text(150, seed=100 + k % 3), f"Item {k}?") for k in range(6)]
    want = [off.generate(prompt=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    got = [small.generate(prompt=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert got == want
    batch = small.generate(prompt=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == want
    stats = small.get_stats()
    assert stats["cache_evicted_tokens"] > 0 and stats["cache_hit_tokens"] > 0
    assert small.flush_cache()
    assert small.scheduler.allocator.free_count == small.scheduler.max_total_tokens


def test_namespaces_do_not_share(engines):
    on, _ = engines
    tok = on.tokenizer
    on.flush_cache()
    prompt = chat(tok, "Secret tenant prompt: " + long_text(100, seed=3), "Hello")
    a1 = on.generate(prompt=prompt, sampling_params={**GREEDY, "cache_salt": "tenant-a"})
    b1 = on.generate(prompt=prompt, sampling_params={**GREEDY, "cache_salt": "tenant-b"})
    d1 = on.generate(prompt=prompt, sampling_params=GREEDY)
    a2 = on.generate(prompt=prompt, sampling_params={**GREEDY, "cache_salt": "tenant-a"})
    assert a1["meta_info"]["cached_tokens"] == 0
    assert b1["meta_info"]["cached_tokens"] == 0
    assert d1["meta_info"]["cached_tokens"] == 0
    assert a2["meta_info"]["cached_tokens"] == a2["meta_info"]["prompt_tokens"] - 1
    assert a1["output_ids"] == b1["output_ids"] == d1["output_ids"] == a2["output_ids"]


def test_flush_cache_refused_while_running_and_returns_pool(engines):
    on, _ = engines
    s = on.scheduler
    stream = on.generate(prompt="Tell me a story.", sampling_params={"max_new_tokens": 30, "ignore_eos": True},
                         stream=True)
    next(stream)
    ok, msg = s.flush_cache()
    assert not ok and "running" in msg
    for _ in stream:
        pass
    assert on.flush_cache()
    assert s.allocator.free_count == s.max_total_tokens and s.cache.total_size == 0
