"""SGLang's native API of a real server, through `requests`."""

import threading
import time

import pytest
import requests

from server_helpers import sse_events, wait_idle

GREEDY = {"temperature": 0, "max_new_tokens": 6}


def generate(base_url, **body):
    r = requests.post(base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_single_and_batch(base_url):
    one = generate(base_url, text="The capital of France is", sampling_params=GREEDY)
    meta = one["meta_info"]
    assert one["text"] and len(one["output_ids"]) == meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] == 5 and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["id"] and meta["e2e_latency"] > 0 and "cached_tokens" in meta
    assert "output_token_logprobs" not in meta
    batch = generate(base_url, text=["The capital of France is", "One, two, three,"], sampling_params=GREEDY)
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["text"] == one["text"] and batch[0]["meta_info"]["id"] != batch[1]["meta_info"]["id"]
    by_ids = generate(base_url, input_ids=[one["output_ids"][:1] + [28]], sampling_params=GREEDY)
    assert isinstance(by_ids, list) and by_ids[0]["meta_info"]["prompt_tokens"] == 2


def test_n2_returns_a_list(base_url):
    out = generate(base_url, text="Say hi:", sampling_params={"max_new_tokens": 3, "n": 2, "temperature": 0})
    assert isinstance(out, list) and len(out) == 2 and out[0]["text"] == out[1]["text"]


def test_streaming_is_cumulative(base_url):
    body = {"text": "The capital of France is", "sampling_params": GREEDY, "stream": True}
    with requests.post(base_url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and a["meta_info"]["finish_reason"] is None
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    plain = generate(base_url, text="The capital of France is", sampling_params=GREEDY)
    assert chunks[-1]["text"] == plain["text"] and chunks[-1]["output_ids"] == plain["output_ids"]


def test_logprobs(base_url):
    out = generate(base_url, text="The capital of France is", sampling_params=GREEDY, return_logprob=True,
                   logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = out["meta_info"]
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == meta["prompt_tokens"] and inp[0][0] is None
    assert all(lp <= 0 for lp, _, _ in inp[1:])
    assert "".join(t for _, _, t in inp) == "The capital of France is"
    assert [tid for _, tid, _ in outp] == out["output_ids"]
    assert "".join(t for _, _, t in outp) == out["text"]
    assert len(meta["output_top_logprobs"]) == 6 and all(len(row) == 2 for row in meta["output_top_logprobs"])
    assert all(row[0][1] == tid for row, (_, tid, _) in zip(meta["output_top_logprobs"], outp))
    bare = generate(base_url, text="The capital of France is", sampling_params=GREEDY, return_logprob=True)
    assert [tid for _, tid, _ in bare["meta_info"]["input_token_logprobs"]] == [inp[-1][1]]
    assert all(t is None for _, _, t in bare["meta_info"]["output_token_logprobs"])


def test_select_style_scoring(base_url):
    """What SGLang's frontend sends for `select`: learn the prefix length, then score each choice."""
    prefix = "The capital of France is"
    first = generate(base_url, text=prefix, sampling_params={"max_new_tokens": 0})
    assert first["text"] == "" and first["meta_info"]["completion_tokens"] == 0
    n = first["meta_info"]["prompt_tokens"]
    choices = [" Paris", " London", " a potato"]
    outs = generate(base_url, text=[prefix + c for c in choices],
                    sampling_params={"max_new_tokens": 0, "temperature": 0}, return_logprob=True,
                    return_text_in_logprobs=True, logprob_start_len=max(n - 2, 0))
    assert len(outs) == 3
    means = []
    for choice, out in zip(choices, outs):
        lps = out["meta_info"]["input_token_logprobs"]
        assert len(lps) == out["meta_info"]["prompt_tokens"] - (n - 2)
        assert "".join(t for _, _, t in lps).endswith(choice)
        vals = [lp for lp, _, _ in lps[2:] if lp is not None]
        means.append(sum(vals) / len(vals))
    assert means.index(max(means)) == 0
    # Unconditional likelihood: input_ids of the scored tokens; without logprob_start_len only the
    # last prompt token is scored (as SGLang), from 0 every one.
    ids = [tid for _, tid, _ in outs[0]["meta_info"]["input_token_logprobs"]]
    out = generate(base_url, input_ids=[ids], sampling_params={"max_new_tokens": 0}, return_logprob=True)
    assert [tid for _, tid, _ in out[0]["meta_info"]["input_token_logprobs"]] == ids[-1:]
    out = generate(base_url, input_ids=[ids], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                   logprob_start_len=0)
    assert [tid for _, tid, _ in out[0]["meta_info"]["input_token_logprobs"]] == ids


def test_abort_request_ends_a_stream(base_url):
    rid = "abort-me-1"
    body = {"text": "Write a very long story.", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
    events = []
    with requests.post(base_url + "/generate", json=body, stream=True, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith(b"data: "):
                events.extend(sse_events([line]))
                break
        assert requests.post(base_url + "/abort_request", json={"rid": rid}, timeout=10).json()["success"]
        events.extend(sse_events(lines))
    assert events[-1] == "[DONE]"
    last = [e for e in events if e != "[DONE]"][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 500
    wait_idle(base_url)


def test_greedy_equals_engine(base_url, default_engine):
    prompts = ["The capital of France is", "List three fruits:"]
    params = {"temperature": 0, "max_new_tokens": 10}
    want = default_engine.generate(prompt=prompts, sampling_params=params)
    for prompt, w in zip(prompts, want):
        got = generate(base_url, text=prompt, sampling_params=params)
        assert got["output_ids"] == w["output_ids"]
        assert got["text"] == w["text"]
        assert got["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]


def test_info_endpoints_flush_and_metrics(base_url):
    info = requests.get(base_url + "/get_model_info").json()
    assert info["model_path"].endswith(".gguf") and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        s = requests.get(base_url + path).json()
        assert s["max_total_tokens"] > 0 and "kv_free_slots" in s and "cache_hit_rate" in s
        assert s["port"] == int(base_url.rsplit(":", 1)[1])
    wait_idle(base_url)
    r = requests.post(base_url + "/flush_cache")
    assert r.status_code == 200
    assert requests.get(base_url + "/health").status_code == 200
    assert requests.get(base_url + "/health_generate", timeout=60).status_code == 200
    text = requests.get(base_url + "/metrics").text
    for name in ("strand:requests_received_total", "strand:prompt_tokens_total",
                 "strand:generation_tokens_total", "strand:time_to_first_token_seconds_bucket",
                 "strand:inter_token_latency_seconds_count", "strand:num_running_reqs",
                 "strand:num_waiting_reqs", "strand:kv_cache_usage", "strand:cache_hit_rate"):
        assert name in text, name
    count = [l for l in text.splitlines() if l.startswith("strand:time_to_first_token_seconds_count")]
    assert int(count[0].split()[-1]) > 0
