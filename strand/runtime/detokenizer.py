"""Token ids -> text, incrementally, per request; and the detokenizer process around it.

`IncrementalDetokenizer` turns one request's output ids into text as they arrive. It decodes a
small window (the last confirmed tokens plus the new ones) rather than the whole output each
time, holds back a trailing U+FFFD (a multi-byte character split across tokens), skips special
tokens when asked, holds back a tail that could still grow into a stop string, and trims the text
at the stop string when the request finishes. It has no sockets, so the in-process Engine uses it
as it is; `DetokenizerManager` keeps one per request and turns scheduler `ReqOutput`s into
`DetokenizedOutput`s; `run_detokenizer_process` puts that manager between two ZMQ sockets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from strand.runtime.io_struct import (
    BatchDetokenizedOutput,
    BatchReqOutput,
    DetokenizedOutput,
    ReqOutput,
    TokenizedGenerateReq,
)

logger = logging.getLogger(__name__)

# Prompt tokens decoded in front of the output so that tokenizers which drop a leading space at
# the start of a sequence (SentencePiece) still produce the right first word.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """One request's output ids -> its text, one batch of new ids at a time.

    `append(ids)` returns the text that is safe to show so far: it never shrinks between calls
    and is a prefix of the final text. `finish(stop_str, matched_token)` returns the final text.
    """

    def __init__(
        self,
        tokenizer,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | tuple[str, ...] = (),
        no_stop_trim: bool = False,
        prompt_ids: list[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in stop if s]
        self.no_stop_trim = no_stop_trim
        self.output_ids: list[int] = []
        self._confirmed = ""  # text of all ids[: self._read] that can no longer change
        # ids = context + output; decoded windows start at _surr (surrounding context).
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        if context and _REPLACEMENT in self._decode(context):
            context = []  # a partial character at the prompt's end would shift the window
        self._ids: list[int] = context
        self._surr = 0
        self._read = len(context)
        self._pending = ""  # decoded text of the unconfirmed tail (may end in U+FFFD)
        self._shown = ""

    def _decode(self, ids: list[int]) -> str:
        kwargs: dict[str, Any] = {"skip_special_tokens": self.skip_special_tokens}
        if not getattr(self.tokenizer, "is_fast", True):
            kwargs["spaces_between_special_tokens"] = self.spaces_between_special_tokens
        return self.tokenizer.decode(ids, **kwargs)

    def _advance(self) -> None:
        surr_text = self._decode(self._ids[self._surr : self._read])
        new_text = self._decode(self._ids[self._surr :])
        tail = new_text[len(surr_text) :] if len(new_text) >= len(surr_text) else ""
        if tail and not tail.endswith(_REPLACEMENT):
            self._confirmed += tail
            self._surr = self._read
            self._read = len(self._ids)
            self._pending = ""
        else:
            self._pending = tail

    @property
    def text(self) -> str:
        """Everything decoded so far, including an unconfirmed tail, before any stop trim."""
        return self._confirmed + self._pending

    def append(self, new_ids: list[int]) -> str:
        if new_ids:
            self.output_ids.extend(new_ids)
            self._ids.extend(new_ids)
            self._advance()
        text = self._confirmed
        for s in self.stop:
            at = text.find(s)
            if at >= 0:  # the scheduler will finish this request; show nothing past the stop
                text = text[: at + len(s)] if self.no_stop_trim else text[:at]
        if not self.no_stop_trim:
            text = text[: len(text) - self._stop_prefix_len(text)]
        # Never shrink what was already shown (defensive; the rules above keep it monotonic).
        if len(text) >= len(self._shown):
            self._shown = text
        return self._shown

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def finish(self, stop_str: str | None = None, matched_token: int | None = None) -> str:
        """The final text: the whole output, trimmed at the stop string or stop token."""
        window = self._ids[self._surr :]
        base = len(self._decode(self._ids[self._surr : self._read]))
        text = self._confirmed + self._decode(window)[base:]
        trim_token = (
            matched_token is not None and not self.no_stop_trim
            and self.output_ids and self.output_ids[-1] == matched_token
        )
        if trim_token:
            # Drop the stop token's own text: the window decoded with and without it.
            own = len(self._decode(window)) - len(self._decode(window[:-1]))
            text = text[: len(text) - max(own, 0)]
        if stop_str and not self.no_stop_trim:
            at = text.find(stop_str)
            if at >= 0:
                text = text[:at]
        self._shown = text
        return text


@dataclass
class DetokenizeSpec:
    """What the detokenizer needs to know about a request before its first output."""

    rid: str
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    return_text_in_logprobs: bool = False
    prompt_tail_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_req(cls, req: TokenizedGenerateReq) -> "DetokenizeSpec":
        sp = req.sampling_params
        return cls(
            rid=req.rid,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            stop=list(sp.stop),
            no_stop_trim=sp.no_stop_trim,
            return_text_in_logprobs=req.return_text_in_logprobs,
            prompt_tail_ids=list(req.input_ids[-_PROMPT_CONTEXT_TOKENS:]),
        )


class DetokenizerManager:
    """Per-request detokenizer state; `ReqOutput`s in, `DetokenizedOutput`s out. No sockets.

    Text and output_ids of a `DetokenizedOutput` are cumulative; the logprob lists in its
    meta_info are incremental (new since the last output for that rid), like `ReqOutput`'s.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.specs: dict[str, DetokenizeSpec] = {}
        self.states: dict[str, IncrementalDetokenizer] = {}

    def register(self, spec: DetokenizeSpec) -> None:
        self.specs[spec.rid] = spec

    def _state(self, rid: str) -> tuple[DetokenizeSpec, IncrementalDetokenizer]:
        spec = self.specs.get(rid) or DetokenizeSpec(rid=rid)
        self.specs[rid] = spec
        state = self.states.get(rid)
        if state is None:
            state = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=spec.skip_special_tokens,
                spaces_between_special_tokens=spec.spaces_between_special_tokens,
                stop=spec.stop,
                no_stop_trim=spec.no_stop_trim,
                prompt_ids=spec.prompt_tail_ids,
            )
            self.states[rid] = state
        return spec, state

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def _triples(self, pairs, with_text: bool) -> list[list[Any]]:
        texts = self.token_texts([t for _, t in pairs]) if with_text else [None] * len(pairs)
        return [[lp, tid, txt] for (lp, tid), txt in zip(pairs, texts)]

    def _top(self, rows, with_text: bool) -> list[Any]:
        return [None if row is None else self._triples(row, with_text) for row in rows]

    def process(self, out: ReqOutput) -> DetokenizedOutput:
        spec, state = self._state(out.rid)
        text = state.append(out.new_token_ids)
        fr = out.finish_reason
        if fr is not None:
            matched = fr.get("matched") if fr.get("type") == "stop" else None
            text = state.finish(
                stop_str=out.stop_str,
                matched_token=matched if isinstance(matched, int) and not isinstance(matched, bool) else None,
            )
            self.specs.pop(out.rid, None)
            self.states.pop(out.rid, None)
        meta: dict[str, Any] = {
            "id": out.rid,
            "finish_reason": fr,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
        }
        with_text = spec.return_text_in_logprobs
        if out.input_token_logprobs is not None:
            meta["input_token_logprobs"] = self._triples(out.input_token_logprobs, with_text)
        if out.output_token_logprobs is not None:
            meta["output_token_logprobs"] = self._triples(out.output_token_logprobs, with_text)
        if out.input_top_logprobs is not None:
            meta["input_top_logprobs"] = self._top(out.input_top_logprobs, with_text)
        if out.output_top_logprobs is not None:
            meta["output_top_logprobs"] = self._top(out.output_top_logprobs, with_text)
        return DetokenizedOutput(
            rid=out.rid,
            text=text,
            output_ids=list(state.output_ids),
            finished=fr is not None,
            meta_info=meta,
        )

    def process_batch(self, outputs: list[ReqOutput]) -> list[DetokenizedOutput]:
        return [self.process(o) for o in outputs]


def run_detokenizer_process(server_args, recv_path: str, send_path: str, ready_conn) -> None:
    """Child process: PULL `DetokenizeSpec` / `BatchReqOutput` from the scheduler at `recv_path`,
    PUSH `BatchDetokenizedOutput` to the tokenizer manager at `send_path`."""
    from strand.runtime.process_utils import child_process_setup, report_ready

    child_process_setup("detokenizer", server_args.log_level)
    import zmq

    from strand.runtime.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(recv_path)
        send = ctx.socket(zmq.PUSH)
        send.connect(send_path)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which shuts down
        report_ready(ready_conn, error=e)
        return
    report_ready(ready_conn, info={})
    manager = DetokenizerManager(tokenizer)
    try:
        while True:
            msg = recv.recv_pyobj()
            if isinstance(msg, DetokenizeSpec):
                manager.register(msg)
            elif isinstance(msg, BatchReqOutput):
                send.send_pyobj(BatchDetokenizedOutput(manager.process_batch(msg.outputs)))
            else:
                logger.error("detokenizer: unexpected message %r", type(msg).__name__)
    except BaseException as e:
        logger.exception("detokenizer: crashed: %s: %s", type(e).__name__, e)
        raise SystemExit(1) from None
