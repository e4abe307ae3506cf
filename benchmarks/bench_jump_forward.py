"""End-to-end JSON generation with jump-forward on vs off, on the default model, in one run.

    python benchmarks/bench_jump_forward.py [--num-schemas 24] [--batch 8] [--dtype bfloat16]

Schemas: the first compilable ones of ../shared/data/jsonschemabench/Github_easy (sorted by file
name). Each is asked greedily for a JSON value (compact whitespace), `--batch` requests at a time.
Reports forward passes, output tokens, tokens/s, and how many outputs are identical with
jump-forward on and off (greedy drafts are verified, so all should be), for forced-text drafts and
for forced text plus prompt lookup. With --temperature > 0 the forced text is appended re-tokenized
(no verification; outputs differ from the run without jump-forward, all stay in the language).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "shared", "data", "jsonschemabench", "Github_easy")


def load_schemas(n: int, compiler) -> list[str]:
    out = []
    for path in sorted(glob.glob(os.path.join(BENCH, "*.json"))):
        with open(path) as f:
            raw = json.load(f)
        schema = raw.get("schema", raw) if isinstance(raw, dict) else raw
        spec = json.dumps(schema)
        try:
            compiler.compile("json", spec)
        except Exception:
            continue
        out.append(spec)
        if len(out) == n:
            break
    return out


def run(engine, prompt: str, schemas: list[str], batch: int, jump_forward: bool, max_new: int,
        lookup: bool = False, temperature: float = 0.0):
    engine.scheduler.args.disable_jump_forward = not jump_forward
    engine.scheduler.draft_lookup = lookup
    s = engine.scheduler.stats
    passes0, jumped0 = s["num_forward_passes"], s["jump_forward_tokens"]
    outs = []
    t = time.perf_counter()
    for i in range(0, len(schemas), batch):
        group = schemas[i:i + batch]
        outs += engine.generate(prompt=[prompt] * len(group),
                                sampling_params=[{"temperature": temperature, "max_new_tokens": max_new, "json_schema": g,
                                                  "seed": 1000 + i + j} for j, g in enumerate(group)])
    dt = time.perf_counter() - t
    tokens = sum(len(o["output_ids"]) for o in outs)
    return dict(outs=outs, seconds=dt, tokens=tokens, passes=s["num_forward_passes"] - passes0,
                jumped=s["jump_forward_tokens"] - jumped0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-schemas", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs must be identical)")
    ap.add_argument("--no-lookup", action="store_true", help="skip the prompt-lookup run")
    args = ap.parse_args()

    from strand.runtime.engine import Engine
    from strand.runtime.tokenizer import apply_chat_template

    engine = Engine(dtype=args.dtype)
    schemas = load_schemas(args.num_schemas, engine.scheduler.grammar_compiler)
    prompt = apply_chat_template(engine.tokenizer, [{"role": "user", "content": "Give an example JSON value."}])
    run(engine, prompt, schemas[:1], 1, True, 8)  # warm up
    T = args.temperature
    runs = [("off", run(engine, prompt, schemas, args.batch, False, args.max_new_tokens, temperature=T)),
            ("on (forced text)", run(engine, prompt, schemas, args.batch, True, args.max_new_tokens, temperature=T))]
    if T == 0 and not args.no_lookup:
        runs.append(("on (forced text + prompt lookup)",
                     run(engine, prompt, schemas, args.batch, True, args.max_new_tokens, lookup=True)))
    off = runs[0][1]
    print(f"{len(schemas)} Github_easy schemas, temperature {T}, batches of {args.batch}, {args.dtype}")
    print("| jump-forward | forward passes | passes saved | output tokens | tokens/s | vs off | forced/draft tokens "
          "| identical to off | finished |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in runs:
        same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(off["outs"], r["outs"]))
        done = sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in r["outs"])
        tps = r["tokens"] / r["seconds"]
        print(f"| {name} | {r['passes']} | {1 - r['passes'] / off['passes']:.1%} | {r['tokens']} | {tps:.1f} | "
              f"{tps / (off['tokens'] / off['seconds']):.2f}x | {r['jumped']} | {same}/{len(schemas)} | {done}/{len(schemas)} |")
    engine.shutdown()


if __name__ == "__main__":
    main()
