"""The tokenizer manager: the HTTP process's side of the pipeline.

It validates and tokenizes requests, fans `n > 1` out into sub-requests, sends them to the
scheduler, and keeps one `ReqState` per request id that the detokenizer's outputs update. The
HTTP layer waits on a state (or streams its updates); a client that goes away gets its request
aborted. Everything here runs on the server's asyncio loop.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from strand.runtime.errors import InvalidRequestError
from strand.runtime.io_struct import (
    AbortReq,
    BatchDetokenizedOutput,
    ControlOut,
    ControlReq,
    DetokenizedOutput,
    TokenizedGenerateReq,
)
from strand.runtime.metrics import ServerMetrics
from strand.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs")
MAX_TOP_LOGPROBS = 20
_DISCONNECT_CHECK_S = 1.0  # how often a non-streaming request checks that its client is still there


class OverloadedError(RuntimeError):
    """More requests in flight than the server accepts; the HTTP layer answers 503."""


class ClientDisconnected(RuntimeError):
    """The client went away while waiting; its requests were aborted."""


class ServerDeadError(RuntimeError):
    """A child process died; nothing more will be answered."""


# One prompt of a request, validated, before the `n` fan-out: the wire message itself, whose
# sub-requests (one per `n`) differ only in rid and seed.
GenerateInput = TokenizedGenerateReq


@dataclass
class ReqState:
    """What the tokenizer manager knows about one (sub-)request while it runs."""

    rid: str
    index: int  # position in the caller's list of results
    return_logprob: bool
    notify: asyncio.Event  # shared by all states of one HTTP call
    created: float = field(default_factory=time.monotonic)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta_info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    dirty: bool = False  # updated since the stream last looked
    first_token_time: float | None = None
    last_token_time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        meta = dict(self.meta_info)
        meta.setdefault("id", self.rid)
        meta.setdefault("finish_reason", None)
        if not self.return_logprob:
            for k in _LOGPROB_KEYS:
                meta.pop(k, None)
        else:
            for k in _LOGPROB_KEYS:
                meta[k] = list(meta.get(k) or [])
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


def _field(name: str, value, kind, *, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidRequestError(name, f"must be an integer, got {type(value).__name__}")
    if kind is bool and not isinstance(value, bool):
        raise InvalidRequestError(name, f"must be a boolean, got {type(value).__name__}")
    if kind is str and not isinstance(value, str):
        raise InvalidRequestError(name, f"must be a string, got {type(value).__name__}")
    return value


# Top-level /generate fields SGLang defines that Strand ignores when they hold nothing.
_IGNORED_NATIVE_FIELDS = {
    "image_data", "video_data", "audio_data", "modalities", "lora_path", "lora_id",
    "custom_logit_processor", "return_hidden_states", "log_metrics", "session_params",
    "token_ids_logprob", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "data_parallel_rank", "input_embeds", "no_logs", "background", "priority",
}
_NATIVE_FIELDS = {
    "text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
}


class TokenizerManager:
    def __init__(self, server_args, tokenizer, scheduler_info: dict, scheduler_path: str, recv_path: str):
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.info = scheduler_info
        self.model_path: str = scheduler_info["model_path"]
        self.context_length: int = scheduler_info["context_length"]
        self.max_total_tokens: int = scheduler_info["max_total_tokens"]
        self.vocab_size: int = scheduler_info.get("vocab_size") or len(tokenizer)
        self.served_model_name = server_args.served_model_name or _model_name(self.model_path)
        self.max_in_flight = server_args.max_running_requests + server_args.max_queued_requests
        self.scheduler_path = scheduler_path
        self.recv_path = recv_path
        self.states: dict[str, ReqState] = {}
        self.control_futures: dict[str, asyncio.Future] = {}
        self.metrics = ServerMetrics()
        self.dead_reason: str | None = None
        self._send = None
        self._recv = None
        self._recv_task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Open the sockets and start the receive loop; call from inside the running loop."""
        import zmq
        import zmq.asyncio

        self._send = zmq.Context.instance().socket(zmq.PUSH)
        self._send.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a full queue
        self._send.connect(self.scheduler_path)
        self._recv = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._recv.setsockopt(zmq.RCVHWM, 0)
        self._recv.bind(self.recv_path)
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    def fail_all(self, reason: str) -> None:
        """A child died: end every request in flight with an abort so no client hangs."""
        self.dead_reason = reason
        for state in list(self.states.values()):
            state.meta_info["finish_reason"] = {"type": "abort", "message": reason, "status_code": 503}
            state.finished = True
            state.dirty = True
            state.notify.set()
        self.states.clear()
        for fut in self.control_futures.values():
            if not fut.done():
                fut.set_exception(ServerDeadError(reason))

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._recv.recv_pyobj()
            try:
                if isinstance(msg, BatchDetokenizedOutput):
                    now = time.monotonic()
                    for out in msg.outputs:
                        self._on_output(out, now)
                elif isinstance(msg, ControlOut):
                    fut = self.control_futures.pop(msg.cid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                else:
                    logger.error("tokenizer manager: unexpected message %r", type(msg).__name__)
            except Exception:  # one bad message must not stop every other request
                logger.exception("tokenizer manager: failed to handle %r", type(msg).__name__)

    def _on_output(self, out: DetokenizedOutput, now: float) -> None:
        state = self.states.get(out.rid)
        if state is None:
            return  # aborted by us (client gone) or unknown
        new_tokens = len(out.output_ids) - len(state.output_ids)
        if new_tokens > 0:
            if state.first_token_time is None:
                state.first_token_time = now
                self.metrics.ttft.observe(now - state.created)
            elif state.last_token_time is not None:
                self.metrics.itl.observe((now - state.last_token_time) / new_tokens, count=new_tokens)
            state.last_token_time = now
        state.text = out.text
        state.output_ids = out.output_ids
        for k, v in out.meta_info.items():
            if k in _LOGPROB_KEYS:
                state.meta_info.setdefault(k, []).extend(v)
            else:
                state.meta_info[k] = v
        if out.finished:
            state.finished = True
            state.meta_info["e2e_latency"] = now - state.created
            self.states.pop(out.rid, None)
            self.metrics.on_finish(state.meta_info, now - state.created)
        state.dirty = True
        state.notify.set()

    # ---- control calls ---------------------------------------------------------------------

    async def control(self, kind: str, timeout: float = 30.0) -> ControlOut:
        if self.dead_reason:
            raise ServerDeadError(self.dead_reason)
        cid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.control_futures[cid] = fut
        self._send.send_pyobj(ControlReq(kind=kind, cid=cid))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.control_futures.pop(cid, None)

    # ---- parsing ---------------------------------------------------------------------------

    def parse_native(self, body: Any) -> tuple[list[GenerateInput], bool]:
        """A /generate body -> its prompts (before the n fan-out) and whether it was a batch."""
        if not isinstance(body, dict):
            raise InvalidRequestError("body", "must be a JSON object")
        for key, value in body.items():
            if key in _NATIVE_FIELDS:
                continue
            if key in _IGNORED_NATIVE_FIELDS and value in (None, False, [], {}, ""):
                continue
            raise InvalidRequestError(key, "unknown or unsupported field")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise InvalidRequestError("text", "give exactly one of text and input_ids")
        if text is not None:
            if isinstance(text, str):
                prompts, batch, name = [text], False, "text"
            elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                prompts, batch, name = list(text), True, "text"
            else:
                raise InvalidRequestError("text", "must be a string or a non-empty list of strings")
        else:
            if _is_id_list(input_ids):
                prompts, batch = [input_ids], False
            elif isinstance(input_ids, list) and input_ids and all(_is_id_list(x) for x in input_ids):
                prompts, batch = list(input_ids), True
            else:
                raise InvalidRequestError("input_ids", "must be a list of token ids or a list of such lists")
            name = "input_ids"

        def per_item(key, default):
            v = body.get(key, default)
            if batch and isinstance(v, list):
                if len(v) != len(prompts):
                    raise InvalidRequestError(key, f"has {len(v)} entries for {len(prompts)} prompts")
                return v
            return [v] * len(prompts)

        sps = per_item("sampling_params", None)
        rids = body.get("rid")
        if rids is None:
            rids = [uuid.uuid4().hex for _ in prompts]
        elif batch:
            if not isinstance(rids, list) or len(rids) != len(prompts) or not all(isinstance(r, str) for r in rids):
                raise InvalidRequestError("rid", "must be a list of strings, one per prompt")
        else:
            rids = [_field("rid", rids, str)]
        stream = bool(_field("stream", body.get("stream", False), bool) or False)
        rtl = _field("return_text_in_logprobs", body.get("return_text_in_logprobs", False), bool) or False
        inputs = []
        for i, prompt in enumerate(prompts):
            sp = SamplingParams.from_dict(copy.deepcopy(sps[i]))
            inputs.append(self.make_input(
                rid=rids[i], prompt=prompt, field_name=name, sampling_params=sp,
                return_logprob=per_item("return_logprob", False)[i],
                logprob_start_len=per_item("logprob_start_len", -1)[i],
                top_logprobs_num=per_item("top_logprobs_num", 0)[i],
                return_text_in_logprobs=rtl, stream=stream,
            ))
        return inputs, batch

    def make_input(self, *, rid: str, prompt, field_name: str, sampling_params: SamplingParams,
                   return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
                   return_text_in_logprobs=False, stream=False, add_special_tokens=True) -> GenerateInput:
        """Tokenize (when `prompt` is text) and check one prompt against the model's limits."""
        return_logprob = bool(_field("return_logprob", return_logprob, bool) or False)
        logprob_start_len = _field("logprob_start_len", logprob_start_len, int)
        logprob_start_len = -1 if logprob_start_len is None else logprob_start_len
        top_logprobs_num = _field("top_logprobs_num", top_logprobs_num, int) or 0
        if isinstance(prompt, str):
            bos = self.tokenizer.bos_token
            if bos and prompt.startswith(bos):
                add_special_tokens = False  # the text already carries it (as the Engine does)
            input_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            input_text = prompt
        else:
            input_ids, input_text = list(prompt), None
            bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(field_name, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        n = len(input_ids)
        if n == 0:
            raise InvalidRequestError(field_name, "the prompt is empty")
        if n >= self.context_length:
            raise InvalidRequestError(
                field_name, f"the prompt has {n} tokens; the model's context length is {self.context_length}"
            )
        if n >= self.max_total_tokens:
            raise InvalidRequestError(
                field_name, f"the prompt has {n} tokens; the KV pool holds {self.max_total_tokens}"
            )
        sp = sampling_params
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_length - n, self.max_total_tokens - n)
        if logprob_start_len < -1:
            raise InvalidRequestError("logprob_start_len", "must be >= -1")
        if return_logprob and logprob_start_len >= n:
            raise InvalidRequestError("logprob_start_len", f"is {logprob_start_len} but the prompt has {n} tokens")
        if return_logprob and logprob_start_len == -1:
            logprob_start_len = n - 1  # as SGLang: by default only the last prompt token is scored
        if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs_num", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        return GenerateInput(
            rid=rid, input_ids=input_ids, sampling_params=sp, input_text=input_text,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            return_text_in_logprobs=bool(return_text_in_logprobs), stream=stream,
        )

    # ---- running requests ------------------------------------------------------------------

    def submit(self, inputs: list[GenerateInput]) -> list[ReqState]:
        """Fan out n, register states, send to the scheduler. Results are ordered prompt-major."""
        if self.dead_reason:
            raise ServerDeadError(self.dead_reason)
        subs: list[tuple[GenerateInput, str]] = []
        for inp in inputs:
            n = inp.sampling_params.n
            for j in range(n):
                subs.append((inp, inp.rid if n == 1 else f"{inp.rid}-{j}"))
        for _, rid in subs:
            if rid in self.states:
                raise InvalidRequestError("rid", f"request id {rid!r} is already running")
        if len(self.states) + len(subs) > self.max_in_flight:
            self.metrics.rejected += 1
            raise OverloadedError(
                f"the server has {len(self.states)} requests in flight; it accepts "
                f"{self.server_args.max_running_requests} running + {self.server_args.max_queued_requests} queued"
            )
        notify = asyncio.Event()
        states = []
        for index, (inp, rid) in enumerate(subs):
            sp = dataclasses.replace(inp.sampling_params, n=1)
            if inp.sampling_params.n > 1 and sp.seed is not None:
                sp.seed = sp.seed + index  # n samples from one seed must differ
            req = dataclasses.replace(inp, rid=rid, sampling_params=sp)
            state = ReqState(rid=rid, index=index, return_logprob=inp.return_logprob, notify=notify)
            self.states[rid] = state
            states.append(state)
            self.metrics.requests_received += 1
            self._send.send_pyobj(req)
        return states

    def abort(self, rid: str) -> bool:
        """Abort a request by id (or all sub-requests `rid-i` of an n > 1 request)."""
        targets = [r for r in self.states if r == rid or (r.startswith(rid + "-") and r[len(rid) + 1:].isdigit())]
        for r in targets:
            # The state stays: the scheduler's final (abort) output ends it for whoever waits.
            self._send.send_pyobj(AbortReq(rid=r))
        return bool(targets)

    def _abort_one(self, rid: str) -> None:
        """The client is gone: forget the request (its last output is dropped) and abort it."""
        state = self.states.pop(rid, None)
        if state is not None and not state.finished:
            self._send.send_pyobj(AbortReq(rid=rid))
            self.metrics.aborted += 1

    def abort_states(self, states: list[ReqState]) -> None:
        for s in states:
            if not s.finished:
                self._abort_one(s.rid)

    async def wait_all(self, states: list[ReqState], is_disconnected=None) -> list[dict[str, Any]]:
        """Wait until every state finishes; abort them all if the client goes away."""
        notify = states[0].notify
        last_check = time.monotonic()
        try:
            while not all(s.finished for s in states):
                try:
                    await asyncio.wait_for(notify.wait(), timeout=_DISCONNECT_CHECK_S)
                    notify.clear()
                except asyncio.TimeoutError:
                    pass
                if is_disconnected is not None and time.monotonic() - last_check >= _DISCONNECT_CHECK_S:
                    last_check = time.monotonic()
                    if await is_disconnected():
                        logger.info("client disconnected; aborting %s", states[0].rid)
                        raise ClientDisconnected(states[0].rid)
        except BaseException:
            self.abort_states(states)
            raise
        return [s.to_dict() for s in states]

    async def stream(self, states: list[ReqState]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield (index, cumulative output) whenever a state changes, until all finish.

        If the consumer stops early (client gone: the generator is closed or cancelled), the
        unfinished requests are aborted.
        """
        notify = states[0].notify
        try:
            while True:
                await notify.wait()
                notify.clear()
                for s in states:
                    if s.dirty:
                        s.dirty = False
                        yield s.index, s.to_dict()
                if all(s.finished for s in states):
                    return
        finally:
            self.abort_states(states)


def _is_id_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _model_name(model_path: str) -> str:
    import os

    base = os.path.basename(model_path.rstrip("/"))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
