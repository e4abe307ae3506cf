"""Start a Strand server on the embedded default model, send it chat requests, stop it.

    python examples/serve_and_chat.py [--port 30000]

What a user does by hand with `python -m strand.launch_server` and the OpenAI client, in one script.
"""

import argparse
import json
import subprocess
import sys
import time
import urllib.request

from openai import OpenAI

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    sys.exit("server did not become ready")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=30000)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen([sys.executable, "-m", "strand.launch_server", "--port", str(args.port)])
    try:
        wait_ready(url, proc)
        client = OpenAI(base_url=url + "/v1", api_key="none")
        for q in QUESTIONS:
            t = time.perf_counter()
            r = client.chat.completions.create(model="default", temperature=0, max_tokens=64,
                                               messages=[{"role": "user", "content": q}])
            dt = time.perf_counter() - t
            n = r.usage.completion_tokens
            print(f"Q: {q}\nA: {r.choices[0].message.content}\n   ({n} tokens, {n / dt:.1f} tok/s)\n")
        r = client.chat.completions.create(
            model="default", temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        print("JSON schema output:", json.loads(r.choices[0].message.content))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
