"""`strand.Engine`: the scheduler in-process, for offline batch use and for tests."""

from __future__ import annotations

import itertools
import logging
import uuid
from typing import Any, Iterator

from strand.runtime.errors import InvalidRequestError
from strand.runtime.io_struct import ReqOutput, TokenizedGenerateReq
from strand.runtime.sampling_params import SamplingParams
from strand.runtime.scheduler import Scheduler
from strand.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Tokenize a prompt; special tokens are added unless the text already starts with BOS."""
    bos = tokenizer.bos_token
    add_special = not (bos and text.startswith(bos))
    return tokenizer.encode(text, add_special_tokens=add_special)


class _Result:
    """One request's accumulated output, SGLang-shaped."""

    def __init__(self, rid: str, tokenizer, params: SamplingParams, return_text_in_logprobs: bool):
        self.rid, self.tokenizer, self.params = rid, tokenizer, params
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {"id": rid, "finish_reason": None}
        self.text_in_lp = return_text_in_logprobs
        self.finished = False
        self.stop_str: str | None = None

    def update(self, out: ReqOutput) -> None:
        self.output_ids.extend(out.new_token_ids)
        m = self.meta
        m.update(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                 cached_tokens=out.cached_tokens, finish_reason=out.finish_reason)
        if out.input_token_logprobs is not None:
            m["input_token_logprobs"] = self._triples(out.input_token_logprobs)
            m["input_top_logprobs"] = [None if t is None else self._triples(t) for t in out.input_top_logprobs]
        if out.output_token_logprobs is not None:
            m.setdefault("output_token_logprobs", []).extend(self._triples(out.output_token_logprobs))
            if out.output_top_logprobs is not None:
                m.setdefault("output_top_logprobs", []).extend(
                    self._triples(t) for t in out.output_top_logprobs)
        if out.finished:
            self.finished = True
            self.stop_str = out.stop_str

    def _triples(self, pairs) -> list:
        if self.text_in_lp:
            return [[lp, tid, self.tokenizer.decode([tid])] for lp, tid in pairs]
        return [[lp, tid, None] for lp, tid in pairs]

    @property
    def text(self) -> str:
        p = self.params
        text = self.tokenizer.decode(self.output_ids, skip_special_tokens=p.skip_special_tokens)
        if self.stop_str and not p.no_stop_trim:
            at = text.find(self.stop_str)
            if at != -1:
                text = text[:at]
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": dict(self.meta)}


class Engine:
    """`Engine(model_path=None, **server_args)`; `generate(...)`; `shutdown()`."""

    def __init__(self, model_path: str | None = None, **kwargs):
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        self.scheduler = Scheduler(self.server_args)
        self.tokenizer = self.scheduler.tokenizer
        self._ids = itertools.count()

    # -------------------------------------------------------------- public API

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 return_text_in_logprobs: bool = False, stream: bool = False):
        """One prompt -> a dict (a list of n dicts when n > 1); a list -> a flat list of dicts.

        With `stream=True`, returns an iterator of chunks `{"index", "text", "delta", "output_ids",
        "meta_info"}`, where `text` is cumulative (as SGLang's HTTP stream) and `delta` is what's new.
        """
        reqs, single = self._build(prompt, input_ids, sampling_params, return_logprob,
                                   logprob_start_len, top_logprobs_num)
        results = [_Result(r.rid, self.tokenizer, r.sampling_params, return_text_in_logprobs) for r in reqs]
        if stream:
            return self._stream(reqs, results)
        for _ in self._run(reqs, results):
            pass
        for res in results:
            reason = res.meta.get("finish_reason") or {}
            if reason.get("status_code") == 400:
                field, _, message = reason["message"].partition(": ")
                raise InvalidRequestError(field, message)
        out = [r.as_dict() for r in results]
        return out[0] if single and len(out) == 1 else out

    def shutdown(self) -> None:
        self.scheduler = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def flush_cache(self) -> bool:
        ok, _ = self.scheduler.flush_cache()
        return ok

    def get_stats(self) -> dict:
        return self.scheduler.get_stats()

    # -------------------------------------------------------------- internals

    def _build(self, prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
               top_logprobs_num) -> tuple[list[TokenizedGenerateReq], bool]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError("prompt", "must be a string or a list of strings")
            ids_list = [encode_prompt(self.tokenizer, t) for t in texts]
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
            texts = [None] * len(ids_list)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise InvalidRequestError("sampling_params", "a list must have one entry per prompt")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids_list)
        reqs = []
        for text, ids, p in zip(texts, ids_list, params):
            base = f"engine-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
            for i in range(p.n):
                sub = p
                if p.n > 1:
                    sub = SamplingParams(**{**p.to_dict(), "n": 1,
                                            "seed": None if p.seed is None else p.seed + i})
                reqs.append(TokenizedGenerateReq(
                    rid=base if p.n == 1 else f"{base}-{i}", input_ids=ids, sampling_params=sub,
                    input_text=text, return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num))
        return reqs, single

    def _run(self, reqs: list[TokenizedGenerateReq], results: list[_Result]) -> Iterator[list[int]]:
        """Add the requests, step the scheduler until all are done; yields indices updated per step."""
        by_rid = {r.rid: i for i, r in enumerate(reqs)}
        for r in reqs:
            self.scheduler.add_request(r)
        pending = len(reqs)
        try:
            while pending:
                touched = []
                for out in self.scheduler.step():
                    i = by_rid.get(out.rid)
                    if i is None:
                        continue
                    results[i].update(out)
                    touched.append(i)
                    if out.finished:
                        pending -= 1
                if touched:
                    yield touched
        finally:
            for r, res in zip(reqs, results):  # a consumer that stops early must not leak KV
                if not res.finished:
                    self.scheduler.abort_request(r.rid)
            if pending:
                self.scheduler.step()  # hand out the abort outputs (nothing else runs in-process)

    def _stream(self, reqs, results) -> Iterator[dict]:
        sent = [""] * len(results)
        for touched in self._run(reqs, results):
            for i in touched:
                res = results[i]
                text = res.text
                delta, sent[i] = text[len(sent[i]):], text
                yield {"index": i, "text": text, "delta": delta, "output_ids": list(res.output_ids),
                       "meta_info": dict(res.meta)}
