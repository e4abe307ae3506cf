"""Server metrics in the Prometheus text format, written by hand (no client library)."""

from __future__ import annotations

import bisect
import math
from typing import Any

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += count
        self.sum += value * count
        self.count += count

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for bound, c in zip(self.buckets, self.counts):
            cum += c
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cum}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_num(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def _num(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


class ServerMetrics:
    """Counters and histograms the tokenizer manager updates; gauges come from the scheduler."""

    def __init__(self):
        self.requests_received = 0
        self.finished_by_reason: dict[str, int] = {}
        self.aborted = 0
        self.rejected = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram("strand:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = Histogram("strand:inter_token_latency_seconds", "Time between output tokens.", _LATENCY_BUCKETS)
        self.e2e = Histogram("strand:e2e_request_latency_seconds", "Request latency, arrival to finish.", _E2E_BUCKETS)

    def on_finish(self, meta: dict[str, Any], latency: float) -> None:
        reason = (meta.get("finish_reason") or {}).get("type", "unknown")
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        self.prompt_tokens += int(meta.get("prompt_tokens") or 0)
        self.generation_tokens += int(meta.get("completion_tokens") or 0)
        self.cached_tokens += int(meta.get("cached_tokens") or 0)
        self.e2e.observe(latency)

    def render(self, stats: dict[str, Any] | None, model_name: str) -> str:
        """The /metrics page. `stats` is the scheduler's get_stats() (None if it did not answer)."""
        lines: list[str] = []

        def metric(name, kind, help_, value, labels: dict | None = None):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{_labels(labels)} {_num(value)}")

        metric("strand:requests_received_total", "counter", "Requests (and n>1 sub-requests) accepted.",
               self.requests_received)
        lines.append("# HELP strand:requests_finished_total Requests finished, by finish reason.")
        lines.append("# TYPE strand:requests_finished_total counter")
        for reason in sorted(set(self.finished_by_reason) | {"stop", "length", "abort"}):
            lines.append(f'strand:requests_finished_total{{reason="{reason}"}} {self.finished_by_reason.get(reason, 0)}')
        metric("strand:requests_aborted_by_client_total", "counter", "Requests aborted because the client left.",
               self.aborted)
        metric("strand:requests_rejected_total", "counter", "Requests refused with 503 (queue full).", self.rejected)
        metric("strand:prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        metric("strand:generation_tokens_total", "counter", "Generated tokens of finished requests.",
               self.generation_tokens)
        metric("strand:cached_tokens_total", "counter", "Prompt tokens served from the radix cache.",
               self.cached_tokens)
        for h in (self.ttft, self.itl, self.e2e):
            lines.extend(h.render())
        if stats:
            total = stats.get("max_total_tokens") or 0
            free = stats.get("kv_free_slots", total)
            gauges = [
                ("strand:num_running_reqs", "Requests in the running batch.", stats.get("num_running_reqs", 0)),
                ("strand:num_waiting_reqs", "Requests waiting to be scheduled.", stats.get("num_waiting_reqs", 0)),
                ("strand:max_total_tokens", "KV pool size in tokens.", total),
                ("strand:kv_free_slots", "KV slots free or evictable.", free),
                ("strand:kv_used_tokens", "KV slots held by running requests or the cache.",
                 stats.get("kv_used", total - free)),
                ("strand:kv_cache_usage", "Fraction of the KV pool not free.",
                 (1.0 - free / total) if total else 0.0),
                ("strand:cache_hit_rate", "Prompt tokens served from the cache / prompt tokens.",
                 stats.get("cache_hit_rate", 0.0)),
            ]
            for name, help_, value in gauges:
                metric(name, "gauge", help_, value)
        return "\n".join(lines) + "\n"


def _labels(labels: dict | None) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
