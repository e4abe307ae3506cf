"""The OpenAI-compatible API: request bodies -> GenerateInputs, results -> OpenAI's shapes."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from strand.runtime.errors import InvalidRequestError
from strand.runtime.sampling_params import SamplingParams
from strand.runtime.tokenizer import apply_chat_template
from strand.runtime.tokenizer_manager import GenerateInput, TokenizerManager, _is_id_list

_NUMBER = (int, float)
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
               bool: "a boolean"}

# name -> (accepted types, sampling_params key or None)
_COMMON_FIELDS: dict[str, tuple[tuple[type, ...], str | None]] = {
    "model": ((str,), None),
    "n": ((int,), "n"),
    "stream": ((bool,), None),
    "stream_options": ((dict,), None),
    "stop": ((str, list), "stop"),
    "max_tokens": ((int,), "max_new_tokens"),
    "temperature": (_NUMBER, "temperature"),
    "top_p": (_NUMBER, "top_p"),
    "seed": ((int,), "seed"),
    "frequency_penalty": (_NUMBER, "frequency_penalty"),
    "presence_penalty": (_NUMBER, "presence_penalty"),
    "user": ((str,), None),
    "logit_bias": ((dict,), None),
    "response_format": ((dict,), None),
    # SGLang's extras
    "top_k": ((int,), "top_k"),
    "min_p": (_NUMBER, "min_p"),
    "min_tokens": ((int,), "min_new_tokens"),
    "regex": ((str,), "regex"),
    "json_schema": ((str, dict), "json_schema"),
    "repetition_penalty": (_NUMBER, "repetition_penalty"),
    "stop_token_ids": ((list,), "stop_token_ids"),
    "ignore_eos": ((bool,), "ignore_eos"),
    "skip_special_tokens": ((bool,), "skip_special_tokens"),
    "no_stop_trim": ((bool,), "no_stop_trim"),
    "rid": ((str,), None),
}
_COMPLETION_FIELDS = dict(_COMMON_FIELDS, prompt=((str, list), None), logprobs=((int,), None),
                          echo=((bool,), None), suffix=((str,), None), best_of=((int,), None))
_CHAT_FIELDS = dict(_COMMON_FIELDS, messages=((list,), None), logprobs=((bool,), None),
                    top_logprobs=((int,), None), max_completion_tokens=((int,), "max_new_tokens"),
                    tools=((list,), None), tool_choice=((str, dict), None),
                    parallel_tool_calls=((bool,), None), continue_final_message=((bool,), None))


@dataclass
class OpenAIRequest:
    kind: str  # "completion" | "chat"
    id: str
    model: str
    inputs: list[GenerateInput]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # completions: top-k count; chat: top_logprobs (0 if only chosen)
    echo: bool = False


def _check_fields(body: Any, fields: dict) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    for key, value in body.items():
        spec = fields.get(key)
        if spec is None or value is None:
            continue  # unknown fields are ignored, as OpenAI and SGLang do
        types = spec[0]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            wanted = "a number" if types == _NUMBER else " or ".join(_TYPE_NAMES[t] for t in types)
            raise InvalidRequestError(key, f"must be {wanted}, got {type(value).__name__}")
    return body


def _sampling_params(body: dict, fields: dict, default_max_tokens: int) -> SamplingParams:
    d: dict[str, Any] = {"max_new_tokens": default_max_tokens}
    for key, (_, target) in fields.items():
        if target is not None and body.get(key) is not None:
            d[target] = body[key]
    if body.get("logit_bias"):
        raise InvalidRequestError("logit_bias", "is not supported")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise InvalidRequestError("response_format.json_schema", "must be an object with a `schema` object")
            d["json_schema"] = json.dumps(spec.get("schema") or {})
        elif kind == "json_object":
            d["json_schema"] = json.dumps({"type": "object"})
        elif kind == "regex":
            pattern = fmt.get("regex", fmt.get("pattern"))
            if not isinstance(pattern, str):
                raise InvalidRequestError("response_format.regex", "must be a string")
            d["regex"] = pattern
        elif kind != "text":
            raise InvalidRequestError("response_format.type", f"unknown {kind!r} (text | json_object | json_schema | regex)")
    try:
        return SamplingParams.from_dict(d)
    except InvalidRequestError as e:
        # Name the field as the client spelled it.
        name = e.field.removeprefix("sampling_params.")
        client_names = [key for key, (_, target) in fields.items() if target == name and key in body]
        raise InvalidRequestError(client_names[0] if client_names else name, e.message) from None


def parse_completion(tm: TokenizerManager, body: Any) -> OpenAIRequest:
    body = _check_fields(body, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_id_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_id_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise InvalidRequestError("prompt", "must be a string, a list of strings, or token ids")
    if body.get("suffix"):
        raise InvalidRequestError("suffix", "is not supported")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise InvalidRequestError("best_of", "is not supported")
    logprobs = body.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise InvalidRequestError("logprobs", "must be in [0, 5]")
    rid = body.get("rid") or f"cmpl-{uuid.uuid4().hex}"
    inputs = []
    for i, p in enumerate(prompts):
        sp = _sampling_params(body, _COMPLETION_FIELDS, default_max_tokens=16)
        inputs.append(tm.make_input(
            rid=rid if len(prompts) == 1 else f"{rid}-p{i}", prompt=p, field_name="prompt", sampling_params=sp,
            return_logprob=logprobs is not None, top_logprobs_num=logprobs or 0,
            return_text_in_logprobs=True, stream=bool(body.get("stream")),
        ))
    return OpenAIRequest(
        kind="completion", id=rid, model=body.get("model") or tm.served_model_name, inputs=inputs,
        n=inputs[0].sampling_params.n, stream=bool(body.get("stream")),
        include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        logprobs=logprobs, echo=bool(body.get("echo")),
    )


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}.content[{j}]", "only {type: text, text: str} parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"{where}.content", "must be a string or a list of text parts")


def parse_chat(tm: TokenizerManager, body: Any) -> OpenAIRequest:
    body = _check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with a string `role`")
        if m["role"] not in ("system", "user", "assistant", "developer", "tool"):
            raise InvalidRequestError(f"messages[{i}].role", f"unknown role {m['role']!r}")
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": _message_text(m.get("content"), f"messages[{i}]")})
    if body.get("tools"):
        raise InvalidRequestError("tools", "tool calling is not supported")
    top = body.get("top_logprobs")
    if top is not None:
        if not 0 <= top <= 20:
            raise InvalidRequestError("top_logprobs", "must be in [0, 20]")
        if not body.get("logprobs"):
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    logprobs = (top or 0) if body.get("logprobs") else None
    if body.get("continue_final_message") and clean[-1]["role"] == "assistant":
        prompt = apply_chat_template(tm.tokenizer, clean, add_generation_prompt=False)
        last = clean[-1]["content"]
        prompt = prompt[: prompt.rfind(last) + len(last)] if last else prompt
    else:
        prompt = apply_chat_template(tm.tokenizer, clean, add_generation_prompt=True)
    sp = _sampling_params(body, _CHAT_FIELDS, default_max_tokens=tm.context_length)
    rid = body.get("rid") or f"chatcmpl-{uuid.uuid4().hex}"
    inp = tm.make_input(
        rid=rid, prompt=prompt, field_name="messages", sampling_params=sp,
        return_logprob=logprobs is not None, top_logprobs_num=logprobs or 0,
        return_text_in_logprobs=True, stream=bool(body.get("stream")), add_special_tokens=False,
    )
    return OpenAIRequest(
        kind="chat", id=rid, model=body.get("model") or tm.served_model_name, inputs=[inp], n=sp.n,
        stream=bool(body.get("stream")), include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        logprobs=logprobs,
    )


# ---- answers ---------------------------------------------------------------------------------


def finish_reason(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return {"stop": "stop", "length": "length"}.get(fr.get("type"), fr.get("type"))


def matched_stop(meta: dict):
    fr = meta.get("finish_reason") or {}
    return fr.get("matched") if fr.get("type") == "stop" else None


def _bytes(text: str | None) -> list[int] | None:
    return list(text.encode("utf-8")) if text is not None else None


def completion_logprobs(meta: dict, start: int, text_offset0: int) -> dict:
    """OpenAI completions logprobs for output tokens [start:] (token texts come from the triples)."""
    toks = (meta.get("output_token_logprobs") or [])[start:]
    tops = (meta.get("output_top_logprobs") or [])[start:]
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset0
    for i, (lp, _tid, text) in enumerate(toks):
        text = text or ""
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        row = tops[i] if i < len(tops) else None
        out["top_logprobs"].append({(t or ""): v for v, _, t in row} if row else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(meta: dict, start: int) -> dict:
    toks = (meta.get("output_token_logprobs") or [])[start:]
    tops = (meta.get("output_top_logprobs") or [])[start:]
    content = []
    for i, (lp, _tid, text) in enumerate(toks):
        row = tops[i] if i < len(tops) else None
        content.append({
            "token": text or "", "logprob": lp, "bytes": _bytes(text or ""),
            "top_logprobs": [{"token": t or "", "logprob": v, "bytes": _bytes(t or "")} for v, _, t in (row or [])],
        })
    return {"content": content}


def usage(results: list[dict], n: int, as_dict: bool = True) -> dict:
    """Prompt tokens count once per prompt (its first sample); completion tokens for every sample."""
    prompt = sum(r["meta_info"].get("prompt_tokens", 0) for r in results[::n])
    cached = sum(r["meta_info"].get("cached_tokens", 0) for r in results[::n])
    completion = sum(r["meta_info"].get("completion_tokens", 0) for r in results)
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_response(req: OpenAIRequest, results: list[dict]) -> dict:
    choices = []
    for i, r in enumerate(results):
        meta = r["meta_info"]
        prefix = req.inputs[i // req.n].input_text or "" if req.echo else ""
        choice = {
            "index": i, "text": prefix + r["text"], "logprobs": None,
            "finish_reason": finish_reason(meta), "matched_stop": matched_stop(meta),
        }
        if req.logprobs is not None:
            choice["logprobs"] = completion_logprobs(meta, 0, len(prefix))
        choices.append(choice)
    return {
        "id": req.id, "object": "text_completion", "created": int(time.time()), "model": req.model,
        "choices": choices, "usage": usage(results, req.n),
    }


def chat_response(req: OpenAIRequest, results: list[dict]) -> dict:
    choices = []
    for i, r in enumerate(results):
        meta = r["meta_info"]
        choices.append({
            "index": i,
            "message": {"role": "assistant", "content": r["text"], "reasoning_content": None, "tool_calls": None},
            "logprobs": chat_logprobs(meta, 0) if req.logprobs is not None else None,
            "finish_reason": finish_reason(meta), "matched_stop": matched_stop(meta),
        })
    return {
        "id": req.id, "object": "chat.completion", "created": int(time.time()), "model": req.model,
        "choices": choices, "usage": usage(results, req.n),
    }


class StreamFormatter:
    """Turns cumulative per-choice outputs into OpenAI stream chunks (deltas)."""

    def __init__(self, req: OpenAIRequest, num_choices: int):
        self.req = req
        self.created = int(time.time())
        self.sent_text = [0] * num_choices
        self.sent_tokens = [0] * num_choices
        self.started = [False] * num_choices
        self.final: list[dict | None] = [None] * num_choices

    def _chunk(self, choice: dict) -> dict:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": self.req.id, "object": obj, "created": self.created, "model": self.req.model,
                "choices": [choice]}

    def chunks(self, index: int, out: dict) -> list[dict]:
        meta = out["meta_info"]
        text = out["text"]
        delta_text = text[self.sent_text[index] :]
        self.sent_text[index] = len(text)
        ntok = len(meta.get("output_token_logprobs") or [])
        start_tok = self.sent_tokens[index]
        self.sent_tokens[index] = ntok
        fr = finish_reason(meta)
        chunks = []
        if self.req.kind == "chat":
            if not self.started[index]:
                self.started[index] = True
                chunks.append(self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}))
            if delta_text or ntok > start_tok or fr is not None:
                chunks.append(self._chunk({
                    "index": index,
                    "delta": {"content": delta_text} if delta_text else {},
                    "logprobs": chat_logprobs(meta, start_tok) if self.req.logprobs is not None else None,
                    "finish_reason": fr, "matched_stop": matched_stop(meta),
                }))
        else:
            prefix = ""
            if self.req.echo and not self.started[index]:
                prefix = self.req.inputs[index // self.req.n].input_text or ""
            self.started[index] = True
            if prefix or delta_text or ntok > start_tok or fr is not None:
                chunks.append(self._chunk({
                    "index": index, "text": prefix + delta_text,
                    "logprobs": completion_logprobs(meta, start_tok, len(text) - len(delta_text))
                    if self.req.logprobs is not None else None,
                    "finish_reason": fr, "matched_stop": matched_stop(meta),
                }))
        if fr is not None:
            self.final[index] = out
        return chunks

    def usage_chunk(self) -> dict | None:
        if not self.req.include_usage or any(f is None for f in self.final):
            return None
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": self.req.id, "object": obj, "created": self.created, "model": self.req.model,
                "choices": [], "usage": usage(self.final, self.req.n)}
