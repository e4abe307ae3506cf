"""Every server argument in one dataclass, parsed from the CLI in one place and passed down."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field


@dataclass
class ServerArgs:
    model_path: str | None = field(
        default=None,
        metadata={"help": "HF folder or .gguf file; default: the embedded SmolLM2-135M-Instruct"},
    )
    tokenizer_path: str | None = field(default=None, metadata={"help": "defaults to model_path"})
    served_model_name: str | None = field(default=None, metadata={"help": "name in /v1/models"})
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | float16"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP host"})
    port: int = field(default=30000, metadata={"help": "HTTP port"})
    api_key: str | None = field(default=None, metadata={"help": "require 'Authorization: Bearer KEY'"})
    # Memory
    kv_cache_memory_gb: float | None = field(
        default=None,
        metadata={"help": "KV pool budget in GiB (CPU default 1.0; GPU: mem_fraction_static of free)"},
    )
    mem_fraction_static: float = field(
        default=0.85, metadata={"help": "GPU: fraction of free memory for weights+KV"}
    )
    max_total_tokens: int | None = field(
        default=None, metadata={"help": "KV pool size in tokens (overrides the memory budget)"}
    )
    context_length: int | None = field(default=None, metadata={"help": "max prompt+output tokens"})
    # Scheduling
    max_running_requests: int = field(default=64, metadata={"help": "max requests in the running batch"})
    max_queued_requests: int = field(default=1024, metadata={"help": "beyond this, 503"})
    chunked_prefill_size: int = field(
        default=512, metadata={"help": "per-step prefill token budget (chunked prefill)"}
    )
    schedule_policy: str = field(default="lpm", metadata={"help": "lpm | dfs-weight | fcfs | random"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "turn off prefix sharing"})
    new_token_ratio: float = field(
        default=0.5, metadata={"help": "admission: fraction of max_new_tokens reserved per request"}
    )
    attention_backend: str = field(default="auto", metadata={"help": "auto | torch | triton"})
    # Constrained decoding
    disable_jump_forward: bool = field(default=False, metadata={"help": "turn off jump-forward"})
    draft_lookup: str = field(
        default="on", metadata={"help": "on | off: greedy constrained requests also draft what followed their "
                                        "last tokens earlier (prompt lookup), verified like forced text"}
    )
    grammar_compile_timeout: float = field(default=30.0, metadata={"help": "seconds per compile"})
    json_whitespace: str = field(
        default="compact", metadata={"help": "JSON whitespace policy: compact | flexible"}
    )
    # Misc
    random_seed: int = field(default=0, metadata={"help": "server-wide default seed"})
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads"})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning"})

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: unknown {self.dtype!r} (auto | float32 | bfloat16 | float16)")
        if self.schedule_policy not in ("lpm", "dfs-weight", "fcfs", "random"):
            raise ValueError(f"schedule_policy: unknown {self.schedule_policy!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend: unknown {self.attention_backend!r}")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size: must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests: must be >= 1")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "") + f" (default: {f.default})"
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_)
            else:
                kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
                parser.add_argument(flag, type=kind, default=f.default, help=help_)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
