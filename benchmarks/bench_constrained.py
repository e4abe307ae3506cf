"""Constrained decoding: compile time, per-token mask time, and jsonschemabench coverage.

  python benchmarks/bench_constrained.py speed --n 20          # strand vs xgrammar vs outlines-core
  python benchmarks/bench_constrained.py coverage --limit 100  # per collection: compile %, valid %
  python benchmarks/bench_constrained.py coverage --convert-only  # schema -> regex only, refusals grouped

Speed: compact-JSON schemas from jsonschemabench that strand compiles; one valid output per schema
(a steered random walk through strand's mask, re-tokenized with the tokenizer itself) is fed to
every engine; the mask time is fill-the-bitmask per token (strand: copy of the state's row);
accept time is separate. Libraries that are not installed are skipped with a note.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from strand.constrained import GrammarCompileError, GrammarCompiler, GrammarMatcher, TokenizerInfo  # noqa: E402

DATA = os.environ.get("JSONSCHEMABENCH", "/work/shared/data/jsonschemabench")
COLLECTIONS = ("Github_trivial", "Github_easy", "Glaiveai2K")


def schema_files(collection: str) -> list[str]:
    return sorted(glob.glob(os.path.join(DATA, collection, "*.json")))


def load_schema(path: str):
    with open(path) as f:
        return json.load(f)


def _dist_to_accept(g) -> np.ndarray:
    T = g.transitions
    dist = np.full(T.shape[0], 10**9)
    dist[g.accepting] = 0
    while True:
        new = np.minimum(dist, np.where(T >= 0, dist[np.maximum(T, 0)], 10**9).min(1) + 1)
        if (new == dist).all():
            return dist
        dist = new


def sample_output(g, seed: int, free_steps: int = 30, max_steps: int = 1500) -> str | None:
    """A random walk through the mask, steered to an end after `free_steps`."""
    rng = random.Random(seed)
    info = g.tokenizer_info
    eos = min(info.eos_token_ids)
    dist = _dist_to_accept(g)
    m = GrammarMatcher(g)
    out = []
    for step in range(max_steps):
        allowed = g.allowed_tokens(m.state)
        if step < free_steps:
            t = int(rng.choice(allowed))
        elif g.allows(m.state, eos):
            t = eos
        else:
            cand = [int(x) for x in rng.sample(list(allowed), min(100, len(allowed))) if x != eos]

            def score(c):
                mm = m.copy()
                mm.accept_token(c)
                return (int(dist[mm.state]), rng.random())

            t = min(cand, key=score)
        if not m.accept_token(t):
            raise AssertionError("mask allowed a refused token")
        if m.is_terminated():
            return b"".join(info.token_bytes[x] for x in out).decode("utf-8")
        out.append(t)
    return None


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


# --- engines: each gives compile(schema) -> handle, and run(handle, ids) -> (first, per-token mask times, accept ok) ---


def timed_walk(ids, fill_mask, accept):
    """Time fill_mask() and accept(t) for each token of `ids`; stops at the first refusal."""
    masks, accepts = [], []
    for t in ids:
        t0 = time.perf_counter()
        fill_mask()
        t1 = time.perf_counter()
        ok = accept(t)
        t2 = time.perf_counter()
        masks.append(t1 - t0)
        accepts.append(t2 - t1)
        if not ok:
            return masks, accepts, False
    return masks, accepts, True


class StrandEngine:
    name = "strand"

    def __init__(self, tok, info):
        self.tok = tok
        self.info = info
        self.compiler = GrammarCompiler(info, cache_size=4096, timeout_s=60)

    def compile(self, schema_str: str):
        return self.compiler.compile("json", schema_str)

    def compile_cold(self, schema_str: str):
        return self.compiler.compile_now("json", schema_str)

    def run(self, g, ids):
        m = GrammarMatcher(g)
        buf = torch.empty(1, g.mask_table.shape[1], dtype=torch.int32)
        return timed_walk(ids + [min(self.info.eos_token_ids)], lambda: buf[0].copy_(g.mask_table[m.state]),
                          m.accept_token)


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tok, info):
        import xgrammar as xgr

        self.xgr = xgr
        self.tinfo = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=info.vocab_size)
        self.compiler = xgr.GrammarCompiler(self.tinfo, cache_enabled=True)
        self.vocab = info.vocab_size
        self.eos = min(info.eos_token_ids)

    def _compile(self, compiler, schema_str):
        return compiler.compile_json_schema(schema_str, any_whitespace=False, separators=(",", ":"))

    def compile(self, schema_str):
        return self._compile(self.compiler, schema_str)

    def compile_cold(self, schema_str):
        c = self.xgr.GrammarCompiler(self.tinfo, cache_enabled=False)
        return self._compile(c, schema_str)

    def run(self, g, ids):
        m = self.xgr.GrammarMatcher(g)
        bm = self.xgr.allocate_token_bitmask(1, self.vocab)
        return timed_walk(ids + [self.eos], lambda: m.fill_next_token_bitmask(bm), m.accept_token)


class OutlinesEngine:
    name = "outlines-core"

    def __init__(self, tok, info):
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
        from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask

        self.Guide, self.Index, self.build = Guide, Index, build_regex_from_schema
        self.alloc, self.fill = allocate_token_bitmask, fill_next_token_bitmask
        self.eos = min(info.eos_token_ids)
        m: dict[bytes, list[int]] = {}
        for tid, tb in enumerate(info.token_bytes):
            if tb is not None:
                m.setdefault(tb, []).append(tid)
        self.vocab = Vocabulary(self.eos, m)
        self.vsize = info.vocab_size
        self.cache = {}

    def compile_cold(self, schema_str):
        return self.Index(self.build(schema_str, ""), self.vocab)

    def compile(self, schema_str):
        if schema_str not in self.cache:
            self.cache[schema_str] = self.compile_cold(schema_str)
        return self.cache[schema_str]

    def run(self, index, ids):
        guide = self.Guide(index)
        bm = self.alloc(self.vsize)
        masks, accepts = [], []
        for t in ids:
            t0 = time.perf_counter()
            self.fill(guide, bm)
            t1 = time.perf_counter()
            ok = bool((int(bm[0, t >> 5]) >> (t & 31)) & 1)
            if ok:
                guide.advance(t)
            t2 = time.perf_counter()
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
            if not ok:
                return masks, accepts, False
        t0 = time.perf_counter()
        self.fill(guide, bm)
        masks.append(time.perf_counter() - t0)
        return masks, accepts, guide.is_finished() or bool((int(bm[0, self.eos >> 5]) >> (self.eos & 31)) & 1)


def make_engines(tok, info):
    engines = [StrandEngine(tok, info)]
    for cls, mod in ((XGrammarEngine, "xgrammar"), (OutlinesEngine, "outlines_core")):
        try:
            engines.append(cls(tok, info))
        except ImportError:
            print(f"[skip] {mod} is not installed")
    return engines


def speed(args, tok, info):
    engines = make_engines(tok, info)
    strand = engines[0]
    files = schema_files("Github_easy")
    random.Random(args.seed).shuffle(files)
    cases = []
    for path in files:
        if len(cases) >= args.n:
            break
        s = json.dumps(load_schema(path))
        try:
            g = strand.compile(s)
        except GrammarCompileError:
            continue
        text = sample_output(g, seed=len(cases))
        if text is None:
            continue
        cases.append((os.path.basename(path), s, tok.encode(text, add_special_tokens=False)))
    print(f"{len(cases)} compact-JSON schemas (Github_easy, strand-compilable, seed {args.seed}); "
          f"{sum(len(c[2]) for c in cases)} output tokens")
    rows = []
    for eng in engines:
        cold, cached, masks, firsts, accepts, fails, n_ok = [], [], [], [], [], 0, 0
        for name, s, ids in cases:
            try:
                t0 = time.perf_counter()
                eng.compile_cold(s)
                cold.append(time.perf_counter() - t0)
                h = eng.compile(s)
                t0 = time.perf_counter()
                h = eng.compile(s)
                cached.append(time.perf_counter() - t0)
            except Exception as e:  # a library refusing a schema is a data point, not a crash
                fails += 1
                if args.verbose:
                    print(f"  {eng.name} cannot compile {name}: {str(e)[:100]}")
                continue
            ms, acc, ok = eng.run(h, ids)
            firsts.append(ms[0])
            masks += ms[1:]
            accepts += acc
            n_ok += ok
        rows.append((eng.name, len(cold), fails, n_ok, cold, cached, firsts, masks, accepts))
    print(f"\n{'engine':14} {'compiled':>8} {'accepted':>8} {'cold ms med':>11} {'cold ms p90':>11} {'cold ms max':>11} "
          f"{'cached us':>9} {'mask us mean':>12} {'mask us p99':>11} {'first us med':>12} {'accept us':>9}")
    for name, n, fails, n_ok, cold, cached, firsts, masks, accepts in rows:
        print(f"{name:14} {n:>8} {n_ok:>8} {statistics.median(cold) * 1e3 if cold else float('nan'):>11.1f} "
              f"{pct(cold, 90) * 1e3:>11.1f} {max(cold) * 1e3 if cold else float('nan'):>11.1f} "
              f"{statistics.median(cached) * 1e6 if cached else float('nan'):>9.1f} "
              f"{np.mean(masks) * 1e6 if masks else float('nan'):>12.2f} {pct(masks, 99) * 1e6:>11.2f} "
              f"{statistics.median(firsts) * 1e6 if firsts else float('nan'):>12.1f} "
              f"{np.mean(accepts) * 1e6 if accepts else float('nan'):>9.2f}")
    print("(accepted = the engine took the whole valid output then EOS; outlines-core and xgrammar see the same token ids)")


def coverage(args, tok, info):
    import jsonschema

    compiler = GrammarCompiler(info, cache_size=8, timeout_s=args.timeout)
    print(f"{'collection':16} {'schemas':>7} {'compiled':>9} {'refused':>8} {'timeout':>8} {'errors':>6} "
          f"{'walked':>6} {'valid':>6} {'compile ms med':>14}")
    reasons: dict[str, int] = {}
    for coll in COLLECTIONS:
        files = schema_files(coll)
        if args.limit:
            random.Random(args.seed).shuffle(files)
            files = files[: args.limit]
        ok = refused = timeouts = errors = walked = valid = 0
        times = []
        for i, path in enumerate(files):
            try:
                schema = load_schema(path)
                s = json.dumps(schema)
            except Exception:
                errors += 1
                continue
            t0 = time.perf_counter()
            try:
                g = compiler.compile("json", s)
            except GrammarCompileError as e:
                msg = str(e)
                if "timed out" in msg:
                    timeouts += 1
                elif "internal" in msg:
                    errors += 1
                    if args.verbose:
                        print("  ERROR", path, msg[:200])
                else:
                    refused += 1
                key = msg.split(":", 2)[1].strip()[:70] if msg.count(":") >= 1 else msg
                reasons[key] = reasons.get(key, 0) + 1
                continue
            times.append(time.perf_counter() - t0)
            ok += 1
            if i % args.walk_every == 0:
                text = sample_output(g, seed=i)
                if text is not None:
                    walked += 1
                    try:
                        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
                        cls(schema).validate(json.loads(text))
                        valid += 1
                    except jsonschema.ValidationError as e:
                        print(f"  INVALID {path}: {e.message[:120]} :: {text[:200]!r}")
                    except Exception as e:
                        print(f"  validator error {path}: {type(e).__name__} {str(e)[:100]}")
        n = len(files)
        print(f"{coll:16} {n:>7} {100 * ok / max(n, 1):>8.1f}% {refused:>8} {timeouts:>8} {errors:>6} "
              f"{walked:>6} {valid:>6} {statistics.median(times) * 1e3 if times else float('nan'):>14.1f}")
    print("\nrefusal reasons (top 15):")
    for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {v:5}  {k}")


def _reason(msg: str) -> str:
    """A refusal message with its schema-specific details (names, numbers, patterns) blanked."""
    msg = msg.split(":", 1)[1].strip() if msg.startswith("json:") else msg
    msg = re.sub(r"\[[^\]]*\]", "[..]", msg)
    msg = re.sub(r"\((?!use)[^)]*\)", "(..)", msg)
    msg = re.sub(r"'[^']*'", lambda m: m[0] if re.fullmatch(r"'[A-Za-z$]+'", m[0]) else "'..'", msg)
    msg = re.sub(r"-?\d+(\.\d+)?", "N", msg)
    return msg[:90]


def convert_coverage(args):
    """Converter-level acceptance (schema -> regex node, no token index), with xgrammar's
    acceptance on the same files when it is installed (xgrammar falls back to a looser grammar
    for keywords it cannot enforce, with a warning)."""
    from strand.constrained.json_schema import JsonSchemaConverter

    xgr = None
    if args.xgrammar:
        try:
            import xgrammar as xgr
        except ImportError:
            print("[skip] xgrammar is not installed")
    reasons: dict[str, list[str]] = {}
    print(f"{'collection':16} {'schemas':>7} {'strand':>8} {'timeout':>8} {'xgrammar':>9}")
    for coll in COLLECTIONS:
        files = schema_files(coll)
        if args.limit:
            random.Random(args.seed).shuffle(files)
            files = files[: args.limit]
        ok = timeouts = xok = 0
        for path in files:
            schema = load_schema(path)
            try:
                JsonSchemaConverter("compact", deadline=time.monotonic() + args.timeout).convert(schema)
                ok += 1
            except GrammarCompileError as e:
                if "timed out" in str(e):
                    timeouts += 1
                reasons.setdefault(_reason(str(e)), []).append(os.path.basename(path))
            except RecursionError:
                reasons.setdefault("RecursionError", []).append(os.path.basename(path))
            if xgr is not None:
                try:
                    xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
                    xok += 1
                except Exception:
                    pass
        n = max(len(files), 1)
        xs = f"{100 * xok / n:>8.1f}%" if xgr is not None else f"{'-':>9}"
        print(f"{coll:16} {len(files):>7} {100 * ok / n:>7.1f}% {timeouts:>8} {xs}", flush=True)
    print("\nrefusal reasons (top 25):")
    for k, v in sorted(reasons.items(), key=lambda kv: -len(kv[1]))[:25]:
        print(f"  {len(v):5}  {k}  (e.g. {', '.join(v[:2])})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["speed", "coverage"])
    ap.add_argument("--n", type=int, default=20, help="speed: number of schemas")
    ap.add_argument("--limit", type=int, default=0, help="coverage: schemas per collection (0 = all)")
    ap.add_argument("--walk-every", type=int, default=5, help="coverage: walk one in this many compiled schemas")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--convert-only", action="store_true",
                    help="coverage: only convert schema -> regex (per-schema --timeout), group the refusals")
    ap.add_argument("--xgrammar", action="store_true", help="coverage --convert-only: xgrammar's acceptance too")
    args = ap.parse_args()
    if args.mode == "coverage" and args.convert_only:
        return convert_coverage(args)
    torch.set_num_threads(1)
    from strand.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer()
    info = TokenizerInfo.from_tokenizer(tok)
    (speed if args.mode == "speed" else coverage)(args, tok, info)


if __name__ == "__main__":
    main()
