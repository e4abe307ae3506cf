"""Compiled grammars, per-request matchers, the compile cache, and the batched mask op."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from strand.constrained.errors import GrammarCompileError
from strand.constrained import regex as R
from strand.constrained.automaton import check_deadline, compile_node
from strand.constrained.fsm import build_token_index
from strand.constrained.json_schema import JsonSchemaConverter
from strand.constrained.tokenizer_info import TokenizerInfo

KINDS = ("regex", "json", "json_object", "choices")
_MAX_FORCED_BYTES = 4096


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A token-level FSM. Immutable and shareable across requests and threads.

    State ids index `mask_table`; state 0 is the start. `transitions[s, b]` is the byte DFA
    (-1 = dead); a token moves a state by walking its bytes.
    """

    kind: str
    spec: str
    tokenizer_info: TokenizerInfo
    transitions: np.ndarray  # int32 [S, 256]
    accepting: np.ndarray  # bool [S]
    mask_table: torch.Tensor  # int32 [S, ceil(V/32)] packed allowed-token bitmask (EOS in accepting states)
    forced_byte: np.ndarray  # int16 [S] the only live byte out of a non-accepting state, else -1
    compile_time_s: float

    @property
    def num_states(self) -> int:
        return self.transitions.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def allows(self, state: int, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab_size:
            return False
        return bool((int(self._mask_np[state, token_id >> 5]) >> (token_id & 31)) & 1)

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Token ids allowed in `state` (for tests and debugging; the hot path uses mask_table)."""
        bits = np.unpackbits(self._mask_np[state].view(np.uint8), bitorder="little")
        return np.nonzero(bits[: self.vocab_size])[0]

    @property
    def _mask_np(self) -> np.ndarray:  # uint32 view sharing memory with mask_table
        return self.__dict__["_mask_u32"]


def _build(kind: str, spec: str, info: TokenizerInfo, source, deadline: float | None, t0: float) -> CompiledGrammar:
    node = R.regex_node(source) if isinstance(source, str) else source
    dfa = compile_node(node, deadline)
    T, acc = dfa.byte_table(), dfa.accepting.copy()
    check_deadline(deadline)
    mask_u32 = build_token_index(T, acc, info, deadline)
    live = T >= 0
    forced = np.where((live.sum(1) == 1) & ~acc, live.argmax(1), -1).astype(np.int16)
    for a in (T, acc, forced):
        a.setflags(write=False)
    table = torch.from_numpy(mask_u32.view(np.int32))  # shares memory with mask_u32
    torch.empty_like(table[0]).copy_(table[0])  # the start state's row, ready for the first mask
    g = CompiledGrammar(kind, spec, info, T, acc, table, forced, time.perf_counter() - t0)
    g.__dict__["_mask_u32"] = mask_u32
    return g


class GrammarMatcher:
    """The state of one request in a CompiledGrammar. Not thread-safe; one per request."""

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self.state = 0
        self._terminated = False
        self._history: list[int] = []  # state before each accepted token
        self._token_bytes = grammar.tokenizer_info.token_bytes
        self._eos = grammar.tokenizer_info.eos_token_ids

    @property
    def num_accepted(self) -> int:
        return len(self._history)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; returns False (state unchanged) if the token is not allowed."""
        if self._terminated or not self.grammar.allows(self.state, token_id):
            return False
        self._history.append(self.state)
        if token_id in self._eos:
            self._terminated = True
            return True
        T = self.grammar.transitions
        s = self.state
        for b in self._token_bytes[token_id]:
            s = T[s, b]
        assert s >= 0, "mask allowed a token that leaves the DFA"
        self.state = int(s)
        return True

    def accept_tokens(self, token_ids) -> bool:
        """Accept tokens in order; on the first refusal, roll back all of them and return False."""
        n0 = self.num_accepted
        for t in token_ids:
            if not self.accept_token(t):
                self.rollback(self.num_accepted - n0)
                return False
        return True

    def rollback(self, k: int) -> None:
        """Undo the last k accepted tokens (EOS included)."""
        if k <= 0:
            return
        if k > len(self._history):
            raise ValueError(f"rollback({k}) past the start ({len(self._history)} tokens accepted)")
        self.state = self._history[-k]
        del self._history[-k:]
        self._terminated = False

    def reset(self) -> None:
        self.rollback(len(self._history))

    def is_terminated(self) -> bool:
        return self._terminated

    def can_terminate(self) -> bool:
        return bool(self.grammar.accepting[self.state])

    def next_token_bitmask(self) -> torch.Tensor:
        """int32 [ceil(V/32)]: a view of the current state's row of the grammar's mask table."""
        return self.grammar.mask_table[self.state]

    def jump_forward_string(self) -> str:
        """The forced text from here: the longest string with exactly one way through the DFA,
        stopping at (not crossing) an accepting state, cut back to whole UTF-8 characters.
        "" when nothing is forced, when terminated, or when the state is inside a character."""
        if self._terminated:
            return ""
        g = self.grammar
        out = bytearray()
        s = self.state
        while len(out) < _MAX_FORCED_BYTES:
            b = int(g.forced_byte[s])
            if b < 0:
                break
            out.append(b)
            s = int(g.transitions[s, b])
        if out and 0x80 <= out[0] < 0xC0:
            return ""
        for cut in range(len(out), max(len(out) - 4, 0) - 1, -1):
            try:
                return out[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""

    def copy(self) -> "GrammarMatcher":
        m = GrammarMatcher.__new__(GrammarMatcher)
        m.grammar, m.state, m._terminated = self.grammar, self.state, self._terminated
        m._history = list(self._history)
        m._token_bytes, m._eos = self._token_bytes, self._eos
        return m


def batch_bitmask(matchers: list[GrammarMatcher]) -> torch.Tensor:
    """int32 [len(matchers), W]: each matcher's current row, stacked (one gather per request)."""
    return torch.stack([m.next_token_bitmask() for m in matchers])


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set disallowed logits to -inf in place.

    logits: float [B, V]; bitmask: int32 [R, ceil(V/32)] packed (bit j of word w = token 32*w+j);
    rows: long [R] the logits rows the bitmask rows apply to (default: all B rows, R == B).
    Token ids past the bitmask's width are disallowed."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be int32 [R, W], got {bitmask.dtype} {tuple(bitmask.shape)}")
    B, V = logits.shape
    R = bitmask.shape[0]
    if (rows is None and R != B) or (rows is not None and rows.numel() != R):
        raise ValueError(f"bitmask has {R} rows for logits of {B} rows and rows={rows}")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(R, -1)  # [R, W*32]
    if allowed.shape[1] >= V:
        allowed = allowed[:, :V]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class GrammarCompiler:
    """Compiles (kind, spec) to CompiledGrammar for one tokenizer; bounded LRU cache; thread-safe.

    whitespace: "compact" (`{"a":1,"b":[1,2]}`, the default), "spaced" (`{"a": 1, "b": [1, 2]}`),
    or "flexible" (up to `max_whitespace` of [ \\t\\n] wherever JSON allows whitespace).
    Compiles run in `num_workers` threads. A compile past `timeout_s` fails its future with
    GrammarCompileError("... timed out ..."); the worker stops at its next deadline check.
    """

    def __init__(
        self,
        tokenizer_info: TokenizerInfo,
        cache_size: int = 256,
        whitespace: str = "compact",
        num_workers: int = 1,
        timeout_s: float = 30.0,
        max_json_depth: int = 3,
        max_whitespace: int = 4,
    ):
        if whitespace not in ("compact", "spaced", "flexible"):
            raise ValueError(f"whitespace must be compact, spaced or flexible, got {whitespace!r}")
        self.tokenizer_info = tokenizer_info
        self.cache_size = cache_size
        self.whitespace = whitespace
        self.timeout_s = timeout_s
        self.max_json_depth = max_json_depth
        self.max_whitespace = max_whitespace
        self._cache: OrderedDict[tuple, CompiledGrammar | GrammarCompileError] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self._tasks: dict[tuple, tuple] = {}  # key -> (worker future, callable), while queued or running
        self._lock = threading.Lock()
        self._num_workers = num_workers
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="grammar-compile")

    # -- public --

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        hit = self._lookup((kind, spec))
        if hit is not None:
            return hit
        return self.compile_async(kind, spec).result()

    def compile_async(self, kind: str, spec: str) -> Future:
        key = (kind, spec)
        with self._lock:
            hit = self._lookup_locked(key)
            if hit is not None:
                f: Future = Future()
                f.set_result(hit)
                return f
            if key in self._inflight:
                return self._inflight[key]
            outer: Future = Future()
            self._inflight[key] = outer
        deadline = time.monotonic() + self.timeout_s
        timer = threading.Timer(self.timeout_s, self._fail_timeout, args=(key, outer))
        timer.daemon = True
        timer.start()

        def run():
            try:
                g = self.compile_now(kind, spec, deadline)
            except GrammarCompileError as e:
                if "timed out" not in str(e):
                    self._store(key, e)
                self._finish(key, outer, exc=e)
            except Exception as e:  # a bug in the compiler must fail the request, not the loop
                self._finish(key, outer, exc=GrammarCompileError(f"{kind}: internal compile error: {type(e).__name__}: {e}"))
            else:
                self._store(key, g)
                self._finish(key, outer, result=g)
            finally:
                timer.cancel()
                with self._lock:
                    self._tasks.pop(key, None)

        with self._lock:
            self._tasks[key] = (self._pool.submit(run), run)
        return outer

    def compile_now(self, kind: str, spec: str, deadline: float | None = None) -> CompiledGrammar:
        """Compile in the calling thread, uncached."""
        t0 = time.perf_counter()
        source = self.to_source(kind, spec, deadline)
        return _build(kind, spec, self.tokenizer_info, source, deadline, t0)

    def to_source(self, kind: str, spec: str, deadline: float | None = None):
        """The regex (str) or regex node (see regex.py) that (kind, spec) compiles through."""
        if kind == "regex":
            if not isinstance(spec, str) or not spec:
                raise GrammarCompileError("regex: empty pattern")
            return spec
        if kind == "choices":
            try:
                choices = json.loads(spec) if isinstance(spec, str) else spec
            except json.JSONDecodeError as e:
                raise GrammarCompileError(f"choices: not a JSON list: {e}") from None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarCompileError("choices: must be a non-empty JSON list of strings")
            return R.alt(*[R.lit(c) for c in choices])
        conv = JsonSchemaConverter(self.whitespace, self.max_json_depth, self.max_whitespace, deadline)
        if kind == "json_object":
            return conv.convert({"type": "object"})
        if kind == "json":
            try:
                schema = json.loads(spec) if isinstance(spec, str) else spec
            except json.JSONDecodeError as e:
                raise GrammarCompileError(f"json: schema is not valid JSON: {e}") from None
            return conv.convert(schema)
        raise GrammarCompileError(f"unknown grammar kind {kind!r}; expected one of {KINDS}")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- cache --

    def _lookup(self, key) -> CompiledGrammar | None:
        with self._lock:
            return self._lookup_locked(key)

    def _lookup_locked(self, key) -> CompiledGrammar | None:
        hit = self._cache.get(key)
        if hit is None:
            return None
        self._cache.move_to_end(key)
        if isinstance(hit, GrammarCompileError):
            raise GrammarCompileError(str(hit))
        return hit

    def _store(self, key, value) -> None:
        with self._lock:
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _finish(self, key, fut: Future, result=None, exc=None) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]
        if fut.done():
            return
        try:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        except Exception:  # InvalidStateError: the timer got there first
            pass

    def _fail_timeout(self, key, fut: Future) -> None:
        # A thread cannot be killed, and the stuck compile may sit inside a long numpy step where no
        # deadline check runs; later compiles go to a fresh pool so they do not queue behind it.
        with self._lock:
            old, self._pool = self._pool, ThreadPoolExecutor(max_workers=self._num_workers, thread_name_prefix="grammar-compile")
        old.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for k, (inner, run) in list(self._tasks.items()):
                if inner.cancelled():  # was queued behind the stuck one: run it on the new pool
                    self._tasks[k] = (self._pool.submit(run), run)
        self._finish(key, fut, exc=GrammarCompileError(f"grammar compile timed out after {self.timeout_s}s"))


def jump_forward_tokens(matcher: GrammarMatcher, output_ids: list[int], tokenizer) -> tuple[int, list[int]] | None:
    """Plan a jump-forward over the matcher's forced string.

    `matcher` must have consumed exactly `output_ids`. Returns (k, new_ids): drop the last k
    output tokens and append new_ids (then `matcher.rollback(k); matcher.accept_tokens(new_ids)`),
    or None when there is nothing to jump.

    Guarantees, when not None:
    - new_ids == T[j:] where T = tokenizer.encode(D + F)[:-1], D the text of the dropped tokens
      output_ids[-k0:], F the forced string, and j the length of the common prefix of T and the
      dropped tokens (k = k0 - j). That is, the dropped tokens plus the forced text are
      re-tokenized exactly as the tokenizer does it, and the last token of that tokenization is
      left to normal decoding (it could merge with whatever follows the forced text).
    - the bytes of new_ids extend the kept output by D plus a non-empty prefix of F, so the output
      text only ever gains forced characters: the set of reachable output texts is unchanged.
    - replaying new_ids from the state before the dropped tokens is accepted by the grammar.
    k0 is 1 (or more, up to 4, if the last token ends inside a UTF-8 character); 0 at the start.
    """
    forced = matcher.jump_forward_string()
    if not forced or matcher.is_terminated():
        return None
    tb = matcher.grammar.tokenizer_info.token_bytes
    k0 = 0
    dropped_text = ""
    if output_ids:
        for k0 in range(1, min(4, len(output_ids)) + 1):
            raw = b"".join(tb[t] or b"" for t in output_ids[-k0:])
            if any(tb[t] is None for t in output_ids[-k0:]):
                return None
            try:
                dropped_text = raw.decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
        else:
            return None
    dropped = list(output_ids[len(output_ids) - k0 :])
    enc = tokenizer.encode(dropped_text + forced, add_special_tokens=False)[:-1]
    j = 0
    while j < min(len(enc), len(dropped)) and enc[j] == dropped[j]:
        j += 1
    new_ids = enc[j:]
    k = k0 - j
    if not new_ids:
        return None
    text_bytes = (dropped_text + forced).encode("utf-8")
    got = b"".join(tb[t] or b"" for t in enc)
    kept = len(b"".join(tb[t] for t in dropped[:j])) if j else 0
    if not text_bytes.startswith(got) or len(got) <= len(dropped_text.encode("utf-8")) or kept > len(got):
        return None
    probe = matcher.copy()
    probe.rollback(k)
    if not probe.accept_tokens(new_ids):
        return None
    return k, new_ids


def accepted_prefix(matcher: GrammarMatcher, token_ids) -> int:
    """How many of `token_ids`, from the first, the matcher accepts in order; its state is unchanged."""
    n = 0
    for t in token_ids:
        if not matcher.accept_token(t):
            break
        n += 1
    matcher.rollback(n)
    return n


def states_before(matcher: GrammarMatcher, k: int) -> list[int]:
    """The states the matcher was in before each of its last k accepted tokens, oldest first."""
    if not 0 <= k <= matcher.num_accepted:
        raise ValueError(f"states_before({k}) with {matcher.num_accepted} tokens accepted")
    return matcher._history[len(matcher._history) - k:]
