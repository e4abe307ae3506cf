"""The scheduler: one process (or the in-process Engine) owns the model, the KV pool and the cache.

Each `step()` is one iteration of continuous batching (see DESIGN.md, "The scheduler's iteration"):
make room for the running decodes (evicting cache, then retracting requests), continue the one
chunked prefill, admit waiting requests in policy order under the token budget and free KV, run one
forward pass over the mixed batch, sample, and report what each request produced.

KV ownership of a request with `req_to_token` row r: `row[:cache_len]` are slots the radix tree
owns (locked through `last_node`); `row[cache_len:kv_len]` are slots the request owns. On finish or
retraction everything it computed is inserted into the tree (which frees duplicates) and the lock
is dropped, so the allocator's free count plus the tree's size is always the whole pool.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from strand.radix_cache import RadixCache, SchedulePolicy
from strand.runtime.draft_lookup import lookup_drafts
from strand.runtime.forward_batch import ForwardBatch
from strand.runtime.io_struct import ReqOutput, TokenizedGenerateReq
from strand.runtime.model_runner import ModelRunner
from strand.runtime.sampler import SampleRow, sample, top_logprobs_of
from strand.runtime.sampling_params import SamplingParams
from strand.runtime.server_args import ServerArgs
from strand.runtime.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

MAX_RESERVE_PER_REQ = 4096  # cap on the decode room one request reserves at admission
MAX_DRAFT = 16  # jump-forward drafts fed to one pass per request


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    stop_ids: list[int] = field(default_factory=list)
    # KV state
    req_pool_idx: int | None = None
    kv_len: int = 0
    cache_len: int = 0
    last_node: Any = None
    cached_tokens: int = 0
    admitted_once: bool = False
    # constrained decoding
    grammar: Any = None  # GrammarMatcher once compiled
    grammar_future: Any = None
    draft: int = 0  # trailing output tokens appended by jump-forward, not yet verified by the model
    # results not yet reported
    finish_reason: dict | None = None
    stop_str: str | None = None
    sent_len: int = 0  # output tokens already reported
    input_logprobs_done: bool = False
    input_logprobs_sent: bool = False
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    sent_lp_len: int = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    # the radix-cache policy reads these
    @property
    def match_key(self) -> list[int]:
        return self.fill_ids

    @property
    def namespace(self) -> str | None:
        return self.params.cache_salt

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.runner = ModelRunner(args)
        if args.draft_lookup not in ("on", "off"):
            raise ValueError(f"draft_lookup must be on or off, got {args.draft_lookup!r}")
        self.draft_lookup = args.draft_lookup == "on"
        self.model_config = self.runner.config
        self.model_path = self.runner.model_path
        self.context_length = self.runner.context_length
        self.max_total_tokens = self.runner.max_total_tokens
        self.tokenizer = load_tokenizer(args.tokenizer_path or self.model_path)
        self.vocab_size = self.model_config.vocab_size
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)

        self.allocator = self.runner.allocator
        self.req_pool = self.runner.req_to_token_pool
        self.req_to_token = self.req_pool.req_to_token
        self.cache = RadixCache(self.allocator.free, disable=args.disable_radix_cache)
        self.policy = SchedulePolicy(args.schedule_policy, self.cache)
        self.generator = torch.Generator().manual_seed(args.random_seed)

        self.waiting: deque[Req] = deque()
        self.grammar_queue: list[Req] = []
        self.running: list[Req] = []  # decoding, KV for all tokens but the last
        self.chunked: Req | None = None  # the one request part-way through its prefill
        self.reqs: dict[str, Req] = {}
        self.pending_outputs: list[ReqOutput] = []
        self.new_token_ratio = args.new_token_ratio
        self._grammar_compiler = None
        self.stats = dict(prompt_tokens_total=0, generation_tokens_total=0, cached_tokens_total=0,
                          num_requests_total=0, num_retractions=0, num_forward_passes=0,
                          jump_forward_tokens=0)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, tr: TokenizedGenerateReq) -> None:
        p = tr.sampling_params
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        req = Req(tr.rid, list(tr.input_ids), p, tr.return_logprob, tr.logprob_start_len,
                  tr.top_logprobs_num, generator=gen,
                  stop_ids=sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)))
        self.stats["num_requests_total"] += 1
        error = self._check_request(req)
        if error:
            self._finish_early(req, error)
            return
        self.reqs[req.rid] = req
        if p.regex is not None or p.json_schema is not None:
            try:
                kind, spec = ("regex", p.regex) if p.regex is not None else ("json", p.json_schema)
                req.grammar_future = self.grammar_compiler.compile_async(kind, spec)
            except Exception as e:  # the compiler itself could not start
                del self.reqs[req.rid]
                self._finish_early(req, f"grammar: {e}")
                return
            self.grammar_queue.append(req)
        else:
            self.waiting.append(req)

    def _check_request(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "input_ids: the prompt is empty"
        if req.rid in self.reqs:
            return f"rid: {req.rid!r} is already in flight"
        if max(req.origin_input_ids) >= self.vocab_size or min(req.origin_input_ids) < 0:
            return f"input_ids: token ids must be in [0, {self.vocab_size})"
        if n + req.params.max_new_tokens > self.context_length:
            return (f"input_ids: prompt ({n} tokens) + max_new_tokens ({req.params.max_new_tokens}) "
                    f"exceeds the context length {self.context_length}")
        if n + 1 > self.max_total_tokens:
            return f"input_ids: prompt ({n} tokens) does not fit the KV pool ({self.max_total_tokens})"
        if req.logprob_start_len >= n:
            return f"logprob_start_len: must be < the prompt length ({n})"
        return None

    def _finish_early(self, req: Req, message: str) -> None:
        req.finish_reason = {"type": "abort", "message": message, "status_code": 400}
        self.pending_outputs.append(ReqOutput(req.rid, [], req.finish_reason,
                                              prompt_tokens=len(req.origin_input_ids)))

    @property
    def grammar_compiler(self):
        if self._grammar_compiler is None:
            from strand.constrained import GrammarCompiler, TokenizerInfo

            info = TokenizerInfo.from_tokenizer(self.tokenizer, vocab_size=self.vocab_size)
            self._grammar_compiler = GrammarCompiler(info, whitespace=self.args.json_whitespace,
                                                     timeout_s=self.args.grammar_compile_timeout)
        return self._grammar_compiler

    def abort_request(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        req.finish_reason = {"type": "abort", "message": "aborted by request"}
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.grammar_queue:
            self.grammar_queue.remove(req)
        elif req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        self._release(req)
        self._emit(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.grammar_queue
                    or self.pending_outputs)

    def flush_cache(self) -> tuple[bool, str]:
        if self.running or self.chunked or self.waiting or self.grammar_queue:
            return False, "flush_cache: refused while requests are running or waiting"
        self.cache.reset()
        return True, "cache flushed"

    def get_stats(self) -> dict:
        cs = self.cache.stats()
        return dict(
            self.stats,
            num_running_reqs=len(self.running) + (self.chunked is not None),
            num_waiting_reqs=len(self.waiting) + len(self.grammar_queue),
            max_total_tokens=self.max_total_tokens,
            kv_free_slots=self.allocator.free_count + self.cache.evictable_size,
            kv_allocator_free=self.allocator.free_count,
            kv_used=self.max_total_tokens - self.allocator.free_count - self.cache.evictable_size,
            cache_total_tokens=self.cache.total_size,
            cache_evictable_tokens=self.cache.evictable_size,
            cache_hit_rate=cs.hit_rate,
            cache_hit_tokens=cs.hit_tokens,
            cache_query_tokens=cs.query_tokens,
            cache_evicted_tokens=cs.evicted_tokens,
            cache_num_nodes=cs.num_nodes,
            context_length=self.context_length,
        )

    # ------------------------------------------------------------------ the iteration

    def step(self) -> list[ReqOutput]:
        self._poll_grammar_queue()
        if self.running or self.chunked or self.waiting:
            self._run_batch()
        out, self.pending_outputs = self.pending_outputs, []
        return out

    def _poll_grammar_queue(self) -> None:
        if not self.grammar_queue:
            return
        from strand.constrained import GrammarMatcher

        still = []
        for req in self.grammar_queue:
            fut = req.grammar_future
            if not fut.done():
                still.append(req)
                continue
            req.grammar_future = None
            try:
                req.grammar = GrammarMatcher(fut.result())
            except Exception as e:
                del self.reqs[req.rid]
                field = "sampling_params.regex" if req.params.regex is not None else "sampling_params.json_schema"
                self._finish_early(req, f"{field}: {e}")
                continue
            self.waiting.append(req)
        self.grammar_queue = still

    def _run_batch(self) -> None:
        self._make_decode_room()
        # A running request usually has one token to feed; after a jump-forward it has several.
        decodes = [r for r in self.running if self._pending(r) == 1]
        extends: list[tuple[Req, int]] = [(r, self._pending(r)) for r in self.running if self._pending(r) > 1]
        budget = self.args.chunked_prefill_size - sum(n for _, n in extends)
        if self.chunked is not None:
            req = self.chunked
            n = min(max(budget, 1), len(req.fill_ids) - req.kv_len)
            extends.append((req, n))
            budget -= n
        self._admit(extends, budget, len(decodes))
        if not extends and not decodes:
            return
        self._forward_and_sample(extends, decodes)

    @staticmethod
    def _pending(req: Req) -> int:
        return len(req.fill_ids) - req.kv_len

    def _available(self) -> int:
        return self.allocator.free_count + self.cache.evictable_size

    def _reserve(self, req: Req) -> int:
        left = max(req.params.max_new_tokens - len(req.output_ids), 0)
        return int(min(left, MAX_RESERVE_PER_REQ) * self.new_token_ratio)

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.allocator.alloc(n)
        if slots is None:
            self.cache.evict(n - self.allocator.free_count)
            slots = self.allocator.alloc(n)
        assert slots is not None, "KV allocation failed after admission checked room"
        return slots

    def _make_decode_room(self) -> None:
        """Running requests need a slot per pending token; evict cache, then retract, until they fit."""
        def need() -> int:
            return sum(self._pending(r) for r in self.running)

        if self.allocator.free_count < need():
            self.cache.evict(need() - self.allocator.free_count)
        retracted = []
        while self.running and self.allocator.free_count < need():
            # fewest output tokens first, longest prompt on ties: the cheapest to redo
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            self.running.remove(victim)
            self._release(victim, finished=False)
            retracted.append(victim)
            self.cache.evict(need() - self.allocator.free_count)
        if retracted:
            self.stats["num_retractions"] += len(retracted)
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
            logger.info("KV pool full: retracted %d requests", len(retracted))
            for r in sorted(retracted, key=lambda r: r.arrival_time, reverse=True):
                self.waiting.appendleft(r)
        else:
            self.new_token_ratio = max(self.args.new_token_ratio, self.new_token_ratio - 0.002)

    def _admit(self, extends: list[tuple[Req, int]], budget: int, num_decodes: int) -> None:
        if not self.waiting or budget <= 0:
            return
        reserved = sum(self._reserve(r) for r in self.running) + num_decodes
        reserved += sum(n for _, n in extends)
        if self.chunked is not None:
            reserved += self._reserve(self.chunked)
        num_running = len(self.running) + sum(1 for r, _ in extends if r is self.chunked)
        admitted = []
        for req in self.policy.order(list(self.waiting)):
            if budget <= 0 or num_running >= self.args.max_running_requests:
                break
            if self.req_pool.free_count == 0:
                break
            fill = req.fill_ids
            max_match = len(fill) - 1
            if req.wants_input_logprobs:  # token s's logprob needs the logits at s - 1
                max_match = min(max_match, max(req.logprob_start_len - 1, 0))
            match = self.cache.match_prefix(fill[:max_match], req.namespace)
            prefix = len(match.slots)
            extend = len(fill) - prefix
            n = extend
            if n > budget:
                if self.chunked is not None or any(r is self.chunked for r, _ in extends):
                    break  # one chunked prefill at a time
                n = budget
            need = n + (self._reserve(req) if n == extend else 0)
            nothing_running = num_running == 0 and num_decodes == 0
            # Lock first: the matched prefix stops being evictable, so it is not room for this request.
            self.cache.inc_lock_ref(match.last_node)
            available = self._available()
            if reserved + need > available and not (nothing_running and n <= available):
                self.cache.dec_lock_ref(match.last_node)
                break
            # Admit: point the request's row at the cached slots.
            req.req_pool_idx = self.req_pool.alloc()
            req.last_node = match.last_node
            self.req_to_token[req.req_pool_idx, :prefix] = match.slots
            req.kv_len = req.cache_len = prefix
            if not req.admitted_once:
                req.admitted_once = True
                req.cached_tokens = prefix
                self.cache.record_hit(prefix, len(fill))
                self.stats["cached_tokens_total"] += prefix
                self.stats["prompt_tokens_total"] += len(req.origin_input_ids)
            reserved += need
            budget -= n
            num_running += 1
            extends.append((req, n))
            admitted.append(req)
            if n < extend:
                self.chunked = req
        for req in admitted:
            self.waiting.remove(req)

    def _forward_and_sample(self, extends: list[tuple[Req, int]], decodes: list[Req]) -> None:
        reqs = [r for r, _ in extends] + decodes
        lens = [n for _, n in extends] + [1] * len(decodes)
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []  # flattened token index of every row we want logits for
        row_spans: list[tuple[int, int]] = []  # per request: (first logits row, count)
        offset = 0
        for req, n in zip(reqs, lens):
            start = req.kv_len
            input_ids.extend(req.fill_ids[start:start + n])
            positions.extend(range(start, start + n))
            completes = start + n == len(req.fill_ids)
            first = start + n - 1 if completes else start + n  # default: only the last token
            if req.wants_input_logprobs:
                first = max(start, req.logprob_start_len - 1, 0)
            elif completes and req.draft:  # rows from the last verified token on check the drafts
                first = max(start, len(req.fill_ids) - 1 - req.draft)
            rows = list(range(offset + first - start, offset + n))
            row_spans.append((len(logits_rows), len(rows)))
            logits_rows.extend(rows)
            offset += n
        out_loc = self._alloc(offset)
        pos = 0
        for req, n in zip(reqs, lens):
            self.req_to_token[req.req_pool_idx, req.kv_len:req.kv_len + n] = out_loc[pos:pos + n]
            pos += n
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_cache_loc=out_loc,
            req_pool_indices=[r.req_pool_idx for r in reqs],
            prefix_lens=[r.kv_len for r in reqs],
            extend_lens=lens,
            num_extends=len(extends),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
            req_to_token=self.req_to_token,
        )
        logits = self.runner.forward(batch)  # [len(logits_rows), V]
        self.stats["num_forward_passes"] += 1

        # Which requests sample this pass, and from which logits row.
        to_sample: list[tuple[Req, int]] = []
        verified: list[Req] = []  # drafts rejected part-way: the model's own token was taken
        for req, n, (r0, cnt) in zip(reqs, lens, row_spans):
            req.kv_len += n
            completes = req.kv_len == len(req.fill_ids)
            if req.wants_input_logprobs:
                self._record_input_logprobs(req, logits[r0:r0 + cnt], req.kv_len - n, completes)
            if not completes:
                self._cache_partial(req)  # chunked prefill: the finished chunk is shareable now
                continue
            if req is self.chunked:
                self.chunked = None
            if req.draft and not self._verify_drafts(req, logits[r0 + cnt - 1 - req.draft:r0 + cnt]):
                verified.append(req)
                continue
            if req.params.max_new_tokens == 0 or len(req.output_ids) >= req.params.max_new_tokens:
                req.finish_reason = {"type": "length", "length": len(req.output_ids)}
                continue
            to_sample.append((req, r0 + cnt - 1))

        if to_sample:
            self._sample(logits, to_sample)

        sampled = {id(r) for r, _ in to_sample} | {id(r) for r in verified}
        for req in reqs:
            if req.finished:
                if req in self.running:
                    self.running.remove(req)
                self._release(req)
                self._emit(req)
            elif id(req) in sampled:  # decoding from now on
                if req not in self.running:
                    self.running.append(req)
                self._emit(req)

    def _sample(self, logits: torch.Tensor, to_sample: list[tuple[Req, int]]) -> None:
        rows = torch.tensor([i for _, i in to_sample], dtype=torch.int64)
        sub = logits[rows]  # [S, V]
        reqs = [r for r, _ in to_sample]
        self._apply_grammar_masks(sub, reqs)
        sample_rows = [SampleRow(r.params, r.origin_input_ids, r.output_ids, r.generator, r.stop_ids,
                                 r.top_logprobs_num if r.return_logprob else 0, r.return_logprob)
                       for r in reqs]
        result = sample(sub, sample_rows, self.generator)
        for j, req in enumerate(reqs):
            tok = result.next_ids[j]
            req.output_ids.append(tok)
            self.stats["generation_tokens_total"] += 1
            if req.return_logprob:
                req.output_token_logprobs.append((result.logprobs[j], tok))
                if result.top_logprobs is not None:
                    req.output_top_logprobs.append(result.top_logprobs[j])
            if req.grammar is not None and not req.grammar.accept_token(tok):
                req.finish_reason = {"type": "abort", "message": f"grammar rejected token {tok}"}
                continue
            self._check_finished(req)
            if req.grammar is not None and not req.finished and not self.args.disable_jump_forward:
                self._jump_forward(req)

    def _jump_forward(self, req: Req) -> None:
        """Append the grammar's forced text as the tokenizer would tokenize it, without sampling it.

        The plan may replace the token just sampled (not yet reported) so the boundary re-tokenizes
        as the tokenizer does; the new tokens are then fed in one extend pass next step.
        """
        from strand.constrained import jump_forward_tokens

        if self._drafts_verifiable(req):
            self._draft(req)
            return
        plan = jump_forward_tokens(req.grammar, req.output_ids, self.tokenizer)
        if plan is None:
            return
        k, new_ids = plan
        unsent = len(req.output_ids) - req.sent_len
        keep = len(req.output_ids) - k
        if k > unsent or keep + len(new_ids) >= req.params.max_new_tokens:
            return  # never take back reported tokens; leave the last tokens to the length limit
        if len(req.origin_input_ids) + keep < req.kv_len:
            return  # would drop tokens whose KV is already written
        req.grammar.rollback(k)
        if not req.grammar.accept_tokens(new_ids):
            return
        self._truncate_output(req, keep)
        self._append_unsampled(req, new_ids)
        self.stats["jump_forward_tokens"] += len(new_ids)
        self.stats["generation_tokens_total"] += len(new_ids) - k

    @staticmethod
    def _truncate_output(req: Req, keep: int) -> None:
        """Drop output tokens from `keep` on, with their logprob entries."""
        del req.output_ids[keep:]
        del req.output_token_logprobs[keep:]
        del req.output_top_logprobs[keep:]

    @staticmethod
    def _append_unsampled(req: Req, ids: list[int]) -> None:
        """Append tokens the model did not sample (forced text): no logprob yet (drafts get theirs
        when checked)."""
        req.output_ids.extend(ids)
        if req.return_logprob:
            req.output_token_logprobs.extend((None, t) for t in ids)
            if req.top_logprobs_num:
                req.output_top_logprobs.extend([] for _ in ids)

    def _draft(self, req: Req) -> None:
        """Greedy: guess the next tokens as drafts; the next pass checks each against the model's own
        choice, so the output is exactly what it would be without jump-forward.

        Two guesses, the longer one is taken: the forced text as the tokenizer encodes it, and what
        followed the request's last few tokens where they occurred before (prompt lookup), cut to
        what the grammar accepts. The model often splits forced text its own way (a key it has not
        seen comes out in short pieces), and repeats that split, its keys and its values; the
        lookup catches those. Drafts stop before any stop token; requests with stop strings get no
        drafts, since the stop-string check runs on sampled tokens only."""
        from strand.constrained import accepted_prefix

        p = req.params
        room = min(p.max_new_tokens - len(req.output_ids) - 1, MAX_DRAFT)
        if room <= 0 or p.stop:
            return
        g = req.grammar
        stops = set(req.stop_ids)

        def usable(ids: list[int]) -> list[int]:  # up to a stop token, then what the grammar accepts
            ids = ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]
            return ids[:accepted_prefix(g, ids)]

        forced = g.jump_forward_string()
        best = usable(self.tokenizer.encode(forced, add_special_tokens=False)[:room]) if forced else []
        if self.draft_lookup:
            for guess in lookup_drafts(req.fill_ids, room):
                guess = usable(guess)
                if guess:  # the longest n-gram whose continuation is usable at all
                    if len(guess) > len(best):
                        best = guess
                    break
        if not best:
            return
        g.accept_tokens(best)
        self._append_unsampled(req, best)
        req.draft = len(best)

    @staticmethod
    def _drafts_verifiable(req: Req) -> bool:
        p = req.params
        return p.is_greedy and not (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
                                    or p.min_new_tokens)

    def _verify_drafts(self, req: Req, logits: torch.Tensor) -> bool:
        """Check the jump-forward drafts against the model. logits [draft + 1, V]: row j predicts
        the token after draft j - 1. Returns True when all drafts hold (the last row is then sampled
        as usual); otherwise keeps the agreeing drafts, takes the model's token at the first
        disagreement, frees the KV computed for the rest, and returns False."""
        from strand.constrained import apply_token_bitmask_, states_before

        m = req.draft
        req.draft = 0
        g = req.grammar
        base = len(req.output_ids) - m
        drafts = req.output_ids[base:]
        masked = logits[:m].clone()  # [m, V]; row j masked by the state before draft j, as sampling would
        states = torch.tensor(states_before(g, m), dtype=torch.int64)
        apply_token_bitmask_(masked, g.grammar.mask_table[states])
        choices = masked.argmax(dim=-1).tolist()
        j = next((i for i, (c, t) in enumerate(zip(choices, drafts)) if c != t), m)
        self.stats["jump_forward_tokens"] += j
        self.stats["generation_tokens_total"] += j
        if j < m:  # the model's greedy token replaces drafts j..m-1
            g.rollback(m - j)
            self._truncate_output(req, base + j)
            ok = g.accept_token(choices[j])
            assert ok, "the masked argmax is allowed by the grammar"
            self._append_unsampled(req, choices[j:j + 1])
            self.stats["generation_tokens_total"] += 1
        if req.return_logprob:  # rows 0..j: the accepted drafts, and the model's token at a disagreement
            n = min(j + 1, m)
            lp = torch.log_softmax(logits[:n], dim=-1)  # [n, V]
            ids = req.output_ids[base:base + n]
            chosen = lp.gather(1, torch.tensor(ids, dtype=torch.int64)[:, None]).squeeze(1).tolist()
            req.output_token_logprobs[base:base + n] = list(zip(chosen, ids))
            if req.top_logprobs_num:
                req.output_top_logprobs[base:base + n] = top_logprobs_of(lp, req.top_logprobs_num)
        if j == m:
            return True
        new_kv = len(req.fill_ids) - 1
        row = self.req_to_token[req.req_pool_idx]
        self.allocator.free(row[new_kv:req.kv_len].clone())
        req.kv_len = new_kv
        self._check_finished(req)
        if not req.finished and not self.args.disable_jump_forward:
            self._jump_forward(req)
        return False

    def _apply_grammar_masks(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        idx = [j for j, r in enumerate(reqs) if r.grammar is not None]
        if not idx:
            return  # unconstrained batches pay nothing
        from strand.constrained import apply_token_bitmask_

        masks = torch.stack([reqs[j].grammar.grammar.mask_table[reqs[j].grammar.state] for j in idx])
        apply_token_bitmask_(logits, masks, torch.tensor(idx, dtype=torch.int64))

    def _check_finished(self, req: Req) -> None:
        tok = req.output_ids[-1]
        p = req.params
        if req.grammar is not None and req.grammar.is_terminated():
            req.finish_reason = {"type": "stop", "matched": tok}
        elif tok in req.stop_ids:  # the sampler masks these while under min_new_tokens
            req.finish_reason = {"type": "stop", "matched": tok}
        elif len(req.output_ids) >= p.max_new_tokens:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        elif len(req.fill_ids) >= self.context_length:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        elif p.stop:
            # Checked every step, so a stop string first appears in a short tail: decode only that.
            tail_tokens = max(len(s) for s in p.stop) + 2
            tail = self.tokenizer.decode(req.output_ids[-tail_tokens:], skip_special_tokens=False)
            for s in p.stop:
                if s in tail:
                    req.finish_reason = {"type": "stop", "matched": s}
                    req.stop_str = s
                    break

    def _record_input_logprobs(self, req: Req, logits: torch.Tensor, start: int, completes: bool) -> None:
        """Logits rows for positions max(start, s - 1) .. of this chunk -> logprobs of prompt tokens s.."""
        prompt = req.origin_input_ids
        s = req.logprob_start_len
        if req.input_token_logprobs is None:  # only the very first token has no logprob
            req.input_token_logprobs = [(None, prompt[0])] if s == 0 else []
            req.input_top_logprobs = [None] if s == 0 else []
        first_pos = max(start, s - 1, 0)
        # row k holds the distribution of token at position first_pos + k + 1
        n_rows = logits.shape[0] - (1 if completes else 0)  # the last row of a full prompt is the output
        if n_rows > 0:
            lp = torch.log_softmax(logits[:n_rows], dim=-1)
            targets = torch.tensor(prompt[first_pos + 1:first_pos + 1 + n_rows], dtype=torch.int64)
            chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
            req.input_token_logprobs.extend(zip(chosen, targets.tolist()))
            if req.top_logprobs_num:
                req.input_top_logprobs.extend(top_logprobs_of(lp, req.top_logprobs_num))
            else:
                req.input_top_logprobs.extend([None] * n_rows)
        if completes:
            req.input_logprobs_done = True

    def _cache_partial(self, req: Req) -> None:
        """Put a chunk-prefilled prefix into the tree and re-point the request at the tree's slots."""
        if self.args.disable_radix_cache:
            return
        key = req.fill_ids[:req.kv_len]
        row = self.req_to_token[req.req_pool_idx]
        self.cache.insert(key, row[:req.kv_len].clone(), req.namespace)
        match = self.cache.match_prefix(key, req.namespace)
        self.cache.inc_lock_ref(match.last_node)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        m = len(match.slots)
        row[:m] = match.slots
        req.cache_len = m

    def _release(self, req: Req, finished: bool = True) -> None:
        """Give back a request's KV: into the tree (duplicates freed) or, cache off, to the allocator."""
        if req.draft:  # unverified jump-forward tokens are dropped, never cached or reported
            req.grammar.rollback(req.draft)
            self._truncate_output(req, len(req.output_ids) - req.draft)
            req.draft = 0
        if req.req_pool_idx is None:
            return
        row = self.req_to_token[req.req_pool_idx]
        slots = row[:req.kv_len].clone()
        if self.args.disable_radix_cache:
            self.allocator.free(slots)
        else:
            self.cache.insert(req.fill_ids[:req.kv_len], slots, req.namespace)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node = None
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = req.cache_len = 0
        if finished:
            self.reqs.pop(req.rid, None)

    def _emit(self, req: Req) -> None:
        verified = len(req.output_ids) - req.draft
        new = req.output_ids[req.sent_len:verified]
        req.sent_len = verified
        out = ReqOutput(
            rid=req.rid, new_token_ids=new, finish_reason=req.finish_reason,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, stop_str=req.stop_str,
        )
        if req.return_logprob:
            if req.input_logprobs_done and not req.input_logprobs_sent:
                out.input_token_logprobs = req.input_token_logprobs
                out.input_top_logprobs = req.input_top_logprobs
                req.input_logprobs_sent = True
            out.output_token_logprobs = req.output_token_logprobs[req.sent_lp_len:verified]
            out.output_top_logprobs = req.output_top_logprobs[req.sent_lp_len:verified] if req.top_logprobs_num else None
            req.sent_lp_len = verified
        self.pending_outputs.append(out)
