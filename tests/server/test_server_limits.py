"""A second server with an API key and a tiny queue: 401, 503 at once, and a child that dies."""

import os
import signal
import threading
import time

import psutil
import pytest
import requests

from server_helpers import start_server, stop_server, wait_idle

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    handle = start_server(tmp_path_factory.mktemp("small"), "--api-key", KEY, "--max-running-requests", "1",
                          "--max-queued-requests", "1", "--max-total-tokens", "4096")
    yield handle
    stop_server(handle)


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def test_api_key(small_server):
    url = small_server.url
    assert requests.get(url + "/health").status_code == 200
    r = requests.get(url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert requests.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.get(url + "/v1/models", headers=auth()).status_code == 200


def test_beyond_max_queued_requests_is_503_at_once(small_server):
    url = small_server.url
    body = {"text": "Tell me a long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    streams = []
    try:
        for _ in range(2):  # one running + one queued
            r = requests.post(url + "/generate", json=body, headers=auth(), stream=True, timeout=60)
            assert r.status_code == 200
            streams.append(r)
        start = time.monotonic()
        r = requests.post(url + "/generate", json=dict(body, stream=False), headers=auth(), timeout=60)
        assert r.status_code == 503 and time.monotonic() - start < 5
        assert "queued" in r.json()["error"]["message"]
    finally:
        for s in streams:
            s.close()  # the server aborts both
    deadline = time.monotonic() + 60
    while True:
        r = requests.post(url + "/generate", headers=auth(), timeout=60,
                          json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200


def test_a_dead_child_takes_the_server_down(small_server):
    children = small_server.children()
    scheduler = [p for p in children if "run_scheduler_process" in " ".join(p.cmdline())
                 or p.pid == _child_pid(small_server, "scheduler")]
    assert scheduler, [(p.pid, p.cmdline()) for p in children]
    scheduler[0].send_signal(signal.SIGKILL)
    code = small_server.proc.wait(30)
    assert code == 1
    log = small_server.log()
    assert "the scheduler process" in log and "died (killed by signal 9)" in log
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def _child_pid(handle, name: str) -> int | None:
    for line in handle.log().splitlines():
        if f"started the {name} process (pid " in line:
            return int(line.rsplit("pid ", 1)[1].rstrip(")"))
    return None
