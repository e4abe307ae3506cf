"""Per-request sampling parameters, validated where they are built."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from strand.runtime.errors import InvalidRequestError

_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None  # a JSON string, as SGLang sends it
    cache_salt: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build and validate from a request's `sampling_params`; unknown keys are an error."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise InvalidRequestError("sampling_params", "must be an object")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in d.items():
            key = _ALIASES.get(key, key)
            if key in ("stop_regex", "return_hidden_states", "structural_tag", "ebnf") and value in (None, [], ""):
                continue  # fields SGLang's frontend always sends; empty means absent
            if key not in names:
                raise InvalidRequestError(f"sampling_params.{key}", "unknown field")
            if value is None and key not in ("seed", "regex", "json_schema", "cache_salt"):
                continue
            kwargs[key] = value
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        def fail(name: str, msg: str):
            raise InvalidRequestError(f"sampling_params.{name}", msg)

        def number(name: str, allow_int_only: bool = False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                fail(name, f"must be a number, got {type(v).__name__}")
            if allow_int_only and not float(v).is_integer():
                fail(name, "must be an integer")
            return v

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            setattr(self, name, int(number(name, allow_int_only=True)))
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            setattr(self, name, float(number(name)))
        if self.max_new_tokens < 0:
            fail("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0:
            fail("min_new_tokens", "must be >= 0")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            fail("top_k", "must be -1 (off) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", "must be in (0, 2]")
        if self.n < 1:
            fail("n", "must be >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            fail("stop", "must be a string or a list of strings")
        self.stop = [s for s in self.stop if s]
        if isinstance(self.stop_token_ids, int) and not isinstance(self.stop_token_ids, bool):
            self.stop_token_ids = [self.stop_token_ids]
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            fail("stop_token_ids", "must be a list of non-negative integers")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            fail("seed", "must be an integer")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        if self.regex is not None and not isinstance(self.regex, str):
            fail("regex", "must be a string")
        if self.json_schema is not None:
            if isinstance(self.json_schema, dict):
                self.json_schema = json.dumps(self.json_schema)
            if not isinstance(self.json_schema, str):
                fail("json_schema", "must be a JSON string or an object")
            try:
                json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                fail("json_schema", f"is not valid JSON: {e}")
        if self.regex is not None and self.json_schema is not None:
            fail("regex", "regex and json_schema cannot both be set")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            fail("cache_salt", "must be a string")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
