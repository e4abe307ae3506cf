"""Messages that travel between the tokenizer manager, the scheduler and the detokenizer.

Small dataclasses, pickled onto ZMQ sockets. One direction, one type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strand.runtime.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReq:
    """Tokenizer manager -> scheduler: one request, already tokenized and validated."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: only output logprobs; k: prompt logprobs from position k
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


@dataclass
class AbortReq:
    """Tokenizer manager -> scheduler: stop this request now and free its KV."""

    rid: str


@dataclass
class ControlReq:
    """Tokenizer manager -> scheduler: a request/answer control call (flush_cache, get_stats)."""

    kind: str  # "flush_cache" | "get_stats"
    cid: str


@dataclass
class ControlOut:
    """Scheduler -> tokenizer manager: the answer to a ControlReq."""

    cid: str
    ok: bool
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReqOutput:
    """What one scheduler step produced for one request.

    `new_token_ids` are the tokens generated since the last ReqOutput for this rid (possibly
    several after a jump-forward, possibly none for a request that finished by abort).
    Logprob lists follow the same incremental rule. `finish_reason` is None until the last one,
    then a dict like SGLang's: {"type": "stop", "matched": str | int} / {"type": "length",
    "length": N} / {"type": "abort", "message": str}.
    """

    rid: str
    new_token_ids: list[int]
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Each entry: (logprob or None, token_id). Text is added by the detokenizer when asked.
    input_token_logprobs: list[tuple[float | None, int]] | None = None  # sent once, first output
    output_token_logprobs: list[tuple[float, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # When finished because of a stop string, the string (the detokenizer trims it).
    stop_str: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BatchReqOutput:
    """Scheduler -> detokenizer: everything one step produced."""

    outputs: list[ReqOutput]


@dataclass
class DetokenizedOutput:
    """Detokenizer -> tokenizer manager: one request's progress, with text.

    `text` is the full text so far (cumulative), already trimmed at a stop string when finished.
    `meta_info` is SGLang-shaped; logprob triples carry text when the request asked for it.
    """

    rid: str
    text: str
    output_ids: list[int]
    finished: bool
    meta_info: dict[str, Any]


@dataclass
class BatchDetokenizedOutput:
    outputs: list[DetokenizedOutput]
