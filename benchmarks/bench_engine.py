"""Engine throughput on the reference workload, against transformers measured in the same run.

    python benchmarks/bench_engine.py                      # everything (takes ~20 min on 2 cores)
    python benchmarks/bench_engine.py --only strand --dtypes bfloat16
    python benchmarks/bench_engine.py --limit 16           # the first 16 requests only

Workload: ../shared/data/workloads/chat64.json (`plain` by default): 64 chat requests arriving at
once, greedy, EOS ignored, each producing exactly its `output_len` tokens.
Prints output tokens/s per system, the ratios, and achieved FLOP/s against the matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_WORKLOAD = os.path.join(HERE, "..", "..", "shared", "data", "workloads", "chat64.json")


def load_workload(path: str, name: str, limit: int | None):
    with open(path) as f:
        reqs = json.load(f)[name]
    return reqs[:limit] if limit else reqs


def matmul_peak_gflops(dtype: torch.dtype, n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def run_strand(reqs, dtype: str, **server_args) -> dict:
    from strand.runtime.engine import Engine

    engine = Engine(dtype=dtype, **server_args)
    params = [{"temperature": 0, "max_new_tokens": r["output_len"], "ignore_eos": True} for r in reqs]
    engine.generate(input_ids=reqs[0]["prompt_ids"], sampling_params={"max_new_tokens": 4})  # warm up
    engine.flush_cache()
    t = time.perf_counter()
    outs = engine.generate(input_ids=[r["prompt_ids"] for r in reqs], sampling_params=params)
    dt = time.perf_counter() - t
    n_out = sum(len(o["output_ids"]) for o in outs)
    assert n_out == sum(r["output_len"] for r in reqs)
    computed = sum(o["meta_info"]["prompt_tokens"] - o["meta_info"]["cached_tokens"] for o in outs)
    stats = engine.get_stats()
    # one request decoding alone
    single = engine.generate(input_ids=reqs[0]["prompt_ids"],
                             sampling_params={"temperature": 0, "max_new_tokens": 64, "ignore_eos": True},
                             stream=True)
    first = next(single)
    t1 = time.perf_counter()
    n1 = 0
    for chunk in single:
        n1 = len(chunk["output_ids"]) - len(first["output_ids"])
    single_tps = n1 / (time.perf_counter() - t1)
    params_count = sum(p.numel() for p in engine.scheduler.runner.model.parameters())
    engine.shutdown()
    return dict(seconds=dt, out_tokens=n_out, tps=n_out / dt, prompt_computed=computed,
                single_decode_tps=single_tps, retractions=stats["num_retractions"],
                passes=stats["num_forward_passes"], params=params_count)


def run_transformers(reqs, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    from strand.runtime.model_config import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    pad = 2
    t = time.perf_counter()
    n_out = 0
    for i in range(0, len(reqs), batch_size):
        group = reqs[i:i + batch_size]
        width = max(r["prompt_len"] for r in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(group):  # left padding
            ids[j, width - r["prompt_len"]:] = torch.tensor(r["prompt_ids"])
            mask[j, width - r["prompt_len"]:] = 1
        new = max(r["output_len"] for r in group)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
        n_out += sum(r["output_len"] for r in group)  # useful tokens only
    dt = time.perf_counter() - t
    return dict(seconds=dt, out_tokens=n_out, tps=n_out / dt)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=DEFAULT_WORKLOAD)
    ap.add_argument("--name", default="plain")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--only", choices=["strand", "transformers", "all"], default="all")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--chunked-prefill-size", type=int, default=512)
    args = ap.parse_args()
    reqs = load_workload(args.workload, args.name, args.limit)
    print(f"workload {args.name}: {len(reqs)} requests, {sum(r['prompt_len'] for r in reqs)} prompt tokens, "
          f"{sum(r['output_len'] for r in reqs)} output tokens; torch threads {torch.get_num_threads()}")
    peaks = {d: matmul_peak_gflops(getattr(torch, d)) for d in args.dtypes.split(",")}
    for d, g in peaks.items():
        print(f"matmul peak {d}: {g:.0f} GFLOP/s")
    results = {}
    if args.only in ("strand", "all"):
        for d in args.dtypes.split(","):
            r = run_strand(reqs, d, max_running_requests=args.max_running_requests,
                           chunked_prefill_size=args.chunked_prefill_size)
            flops = 2 * r["params"] * (r["out_tokens"] + r["prompt_computed"])
            r["gflops"] = flops / r["seconds"] / 1e9
            results[f"strand {d}"] = r
            print(f"strand {d}: {r['tps']:.1f} out tok/s ({r['seconds']:.1f}s, {r['passes']} passes, "
                  f"{r['retractions']} retractions); single request decode {r['single_decode_tps']:.1f} tok/s; "
                  f"achieved {r['gflops']:.0f} GFLOP/s = {r['gflops'] / peaks[d]:.0%} of peak", flush=True)
    if args.only in ("transformers", "all"):
        for bs in (1, 16):
            r = run_transformers(reqs, bs)
            results[f"transformers bs={bs}"] = r
            print(f"transformers fp32 batch {bs}: {r['tps']:.1f} out tok/s ({r['seconds']:.1f}s)", flush=True)
    print("\n| system | out tok/s | vs transformers one-at-a-time | vs static batch 16 |")
    print("| --- | --- | --- | --- |")
    one = results.get("transformers bs=1", {}).get("tps")
    static = results.get("transformers bs=16", {}).get("tps")
    for name, r in results.items():
        ra = f"{r['tps'] / one:.1f}x" if one else "-"
        rb = f"{r['tps'] / static:.1f}x" if static else "-"
        print(f"| {name} | {r['tps']:.1f} | {ra} | {rb} |")


if __name__ == "__main__":
    main()
