"""Many clients at once, clients that vanish, and bad input: the server keeps serving everyone."""

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
import requests

from server_helpers import sse_events, wait_idle

N_CONCURRENT = 64


async def _stream_one(client: httpx.AsyncClient, base_url: str, body: dict) -> tuple[str, dict]:
    deltas = []
    async with client.stream("POST", base_url + "/generate", json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            deltas.extend(sse_events([line]))
    assert deltas[-1] == "[DONE]"
    chunks = deltas[:-1]
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
    return chunks[-1]["text"], chunks[-1]


def test_64_concurrent_streams_match_plain_and_free_all_kv(base_url):
    bodies = [{"text": f"Question {i}: what comes after {i}? Answer:",
               "sampling_params": {"temperature": 0, "max_new_tokens": 3 + i % 3}} for i in range(N_CONCURRENT)]

    async def run():
        limits = httpx.Limits(max_connections=N_CONCURRENT + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            return await asyncio.gather(*(_stream_one(client, base_url, b) for b in bodies))

    streamed = asyncio.run(run())
    assert all(last["meta_info"]["finish_reason"] is not None for _, last in streamed)
    plain = requests.post(base_url + "/generate", timeout=600, json={
        "text": [b["text"] for b in bodies], "sampling_params": [b["sampling_params"] for b in bodies]}).json()
    assert len(plain) == N_CONCURRENT
    for (text, last), p in zip(streamed, plain):
        assert last["output_ids"] == p["output_ids"]
        assert text == p["text"]
    info = wait_idle(base_url)
    assert info["kv_free_slots"] == info["max_total_tokens"]


@pytest.mark.parametrize("stream", [True, False])
def test_killed_client_frees_its_slots(base_url, stream):
    client = textwrap.dedent(f"""
        import requests
        body = {{"text": "Tell me a long story.", "stream": {stream},
                 "sampling_params": {{"max_new_tokens": 1000, "ignore_eos": True}}}}
        print("sending", flush=True)
        with requests.post("{base_url}/generate", json=body, stream=True) as r:
            for line in r.iter_lines():
                pass
    """)
    proc = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "sending"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the server is generating for it
            stats = requests.get(base_url + "/get_server_info").json()
            if stats["num_running_reqs"] >= 1 and stats["kv_free_slots"] < stats["max_total_tokens"]:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the request never started: {stats}")
    finally:
        proc.kill()
        proc.wait()
    # 1000 tokens would take minutes; the abort frees everything in seconds.
    wait_idle(base_url, timeout=60)


CTX_PLACEHOLDER = "__context_length__"

BAD = [
    # (path, raw body or json, the field the 400 must name)
    ("/generate", b"{not json", "body"),
    ("/generate", [1, 2], "body"),
    ("/generate", {"sampling_params": {"max_new_tokens": 1}}, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "text"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"no_such_param": 1}}, "sampling_params.no_such_param"),
    ("/generate", {"text": "hi", "stream": "yes"}, "stream"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ("/generate", {"input_ids": [10**9]}, "input_ids"),
    ("/generate", {"input_ids": CTX_PLACEHOLDER}, "input_ids"),
    ("/v1/completions", {"prompt": CTX_PLACEHOLDER, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 2.0}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, "response_format.type"),
]


def test_bad_inputs_get_400_naming_the_field_and_harm_no_one(base_url):
    context_length = requests.get(base_url + "/get_model_info").json()["context_length"]
    # A request in flight the whole time: it must finish normally.
    result = {}

    def bystander():
        body = {"text": "Count to ten:", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        result["out"] = requests.post(base_url + "/generate", json=body, timeout=300).json()

    t = threading.Thread(target=bystander)
    t.start()
    failures = []
    for path, body, field in BAD:
        if isinstance(body, dict):
            body = {k: ([7] * context_length if v == CTX_PLACEHOLDER else v) for k, v in body.items()}
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = requests.post(base_url + path, data=data, headers={"content-type": "application/json"}, timeout=60)
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != 400 or err.get("param") != field or field.split(".")[-1] not in err.get("message", ""):
            failures.append((path, str(body)[:80], r.status_code, r.text[:200]))
    t.join()
    assert not failures, failures
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "length"
    assert requests.get(base_url + "/health_generate", timeout=60).status_code == 200
