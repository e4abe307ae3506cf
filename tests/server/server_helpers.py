"""Helpers for the server tests: start/stop a real server subprocess, read SSE, wait until idle."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil
import requests

STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []


def start_server(log_dir, *args: str) -> ServerHandle:
    """Start `python -m strand.launch_server` on a free port; return once /health answers 200."""
    port = free_port()
    log_path = os.path.join(str(log_dir), f"server-{port}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "strand.launch_server", "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting:\n{handle.log()}")
        try:
            if requests.get(handle.url + "/health", timeout=2).status_code == 200:
                return handle
        except requests.RequestException:
            pass
        time.sleep(0.5)
    stop_server(handle)
    raise RuntimeError(f"the server did not become healthy in {STARTUP_TIMEOUT_S}s:\n{handle.log()}")


def stop_server(handle: ServerHandle, timeout: float = 30.0) -> tuple[int | None, list[psutil.Process]]:
    """SIGTERM the server; return its exit code and any child process still alive afterwards."""
    children = handle.children()
    if handle.proc.poll() is None:
        handle.proc.send_signal(signal.SIGTERM)
    try:
        code = handle.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        handle.proc.kill()
        code = None
    _, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:  # never leave one behind, even when the test fails
        p.kill()
    return code, alive


def sse_events(lines) -> list:
    """Parse `data: ...` lines of a server-sent event stream; the last item is '[DONE]'."""
    events = []
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_idle(base_url: str, timeout: float = 60.0) -> dict:
    """Poll /get_server_info until no request runs or waits and every KV slot is free."""
    deadline = time.monotonic() + timeout
    info = {}
    while time.monotonic() < deadline:
        info = requests.get(base_url + "/get_server_info", timeout=10).json()
        if (info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
                and info["kv_free_slots"] == info["max_total_tokens"]):
            return info
        time.sleep(0.2)
    raise AssertionError(f"server not idle after {timeout}s: {info}")
