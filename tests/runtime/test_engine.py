"""The in-process Engine: continuous batching, chunked prefill, retraction, streaming, logprobs."""

import random

import pytest
import torch

from strand.runtime.engine import Engine
from strand.runtime.errors import InvalidRequestError
from strand.runtime.model_config import default_model_path


@pytest.fixture(scope="module")
def tiny_engine_factory(tiny_llama):
    engines = []

    def make(**kw):
        e = Engine(model_path=tiny_llama, tokenizer_path=default_model_path(), dtype="float32", **kw)
        engines.append(e)
        return e
    yield make
    for e in engines:
        e.shutdown()


def rand_prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_pool_back_to_start(engine):
    s = engine.scheduler
    assert not s.has_work()
    assert engine.flush_cache()
    assert s.allocator.free_count == s.max_total_tokens
    assert s.req_pool.free_count == s.req_pool.max_reqs
    assert s.cache.total_size == 0


def test_burst_larger_than_pool_matches_alone(tiny_engine_factory):
    prompts = rand_prompts(64, 20, 80, seed=1)
    rng = random.Random(2)
    params = [{"temperature": 0, "max_new_tokens": rng.randint(8, 40), "ignore_eos": True} for _ in prompts]
    alone_engine = tiny_engine_factory(max_total_tokens=4096)
    alone = [alone_engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p, sp in zip(prompts, params)]

    small = tiny_engine_factory(max_total_tokens=700, chunked_prefill_size=64, max_running_requests=32)
    outs = small.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == alone
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert small.get_stats()["num_retractions"] > 0  # the pool really was too small
    assert_pool_back_to_start(small)


def test_chunked_prefill_equals_whole_prefill(tiny_engine_factory):
    prompt = rand_prompts(1, 300, 300, seed=3)[0]
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    whole = tiny_engine_factory(chunked_prefill_size=4096, disable_radix_cache=True).generate(input_ids=prompt, sampling_params=sp)
    e = tiny_engine_factory(chunked_prefill_size=50)
    chunked = e.generate(input_ids=prompt, sampling_params=sp)
    assert chunked["output_ids"] == whole["output_ids"]
    assert_pool_back_to_start(e)


def test_prompt_logprobs_match_reference(tiny_engine_factory, tiny_llama):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = rand_prompts(1, 40, 40, seed=4)[0]
    e = tiny_engine_factory(chunked_prefill_size=16)
    out = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                     logprob_start_len=5, top_logprobs_num=2)
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), -1)
    got = out["meta_info"]["input_token_logprobs"]
    assert len(got) == len(prompt) - 5
    for k, (value, tid, _) in enumerate(got, start=5):
        assert tid == prompt[k]
        assert abs(value - float(lp[k - 1, tid])) < 1e-4
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    whole = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                       logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    assert whole[0][0] is None and len(whole) == len(prompt)
    assert [round(x[0], 4) for x in whole[5:]] == [round(x[0], 4) for x in got]
    assert_pool_back_to_start(e)


def test_output_logprobs_and_streaming(tiny_engine_factory):
    e = tiny_engine_factory()
    prompt = rand_prompts(1, 10, 10, seed=5)[0]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    full = e.generate(input_ids=prompt, sampling_params=sp, return_logprob=True, top_logprobs_num=3)
    lps = full["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == full["output_ids"]
    assert all(top[0][1] == t for top, (_, t, _) in zip(full["meta_info"]["output_top_logprobs"], lps))
    chunks = list(e.generate(input_ids=prompt, sampling_params=sp, stream=True))
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert "".join(c["delta"] for c in chunks) == chunks[-1]["text"] == full["text"]


def test_stream_closed_early_frees_kv(tiny_engine_factory):
    e = tiny_engine_factory()
    it = e.generate(input_ids=rand_prompts(1, 30, 30, seed=6)[0],
                    sampling_params={"max_new_tokens": 50, "ignore_eos": True}, stream=True)
    next(it)
    next(it)
    it.close()
    assert_pool_back_to_start(e)


def test_n_and_seed(tiny_engine_factory):
    e = tiny_engine_factory()
    prompt = rand_prompts(1, 10, 10, seed=7)[0]
    sp = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "seed": 11, "n": 3}
    a = e.generate(input_ids=prompt, sampling_params=sp)
    b = e.generate(input_ids=prompt, sampling_params=sp)
    assert len(a) == 3 and [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    assert len({tuple(x["output_ids"]) for x in a}) > 1


def test_stop_token_ids_and_stop_strings(default_engine):
    from strand.runtime.tokenizer import apply_chat_template

    tok = default_engine.tokenizer
    prompt = apply_chat_template(tok, [{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    base = default_engine.generate(prompt=prompt, sampling_params={"temperature": 0, "max_new_tokens": 40})
    assert "5" in base["text"]
    out = default_engine.generate(prompt=prompt, sampling_params={"temperature": 0, "max_new_tokens": 40, "stop": ["5"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "5"}
    assert out["text"] == base["text"][:base["text"].index("5")]
    first = base["output_ids"][2]
    out = default_engine.generate(prompt=prompt, sampling_params={"temperature": 0, "max_new_tokens": 40,
                                                                   "stop_token_ids": [first]})
    assert out["output_ids"] == base["output_ids"][:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_bad_requests_raise_and_leave_engine_healthy(tiny_engine_factory):
    e = tiny_engine_factory(context_length=256)
    with pytest.raises(InvalidRequestError, match="context length"):
        e.generate(input_ids=[5] * 250, sampling_params={"max_new_tokens": 10})
    with pytest.raises(InvalidRequestError, match="input_ids"):
        e.generate(input_ids=[10_000], sampling_params={"max_new_tokens": 1})
    with pytest.raises(InvalidRequestError, match="temperature"):
        e.generate(input_ids=[5, 6], sampling_params={"temperature": -1})
    with pytest.raises(InvalidRequestError, match="prompt"):
        e.generate()
    ok = e.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert len(ok["output_ids"]) == 3
    assert_pool_back_to_start(e)
