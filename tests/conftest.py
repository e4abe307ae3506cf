import os

import pytest
import torch

# Two cores: keep torch from oversubscribing them when tests run beside subprocesses.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def build_tiny_checkpoint(path, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """A random Llama-family checkpoint (config.json + safetensors) in `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = dict(TINY, **overrides)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    else:
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def default_engine():
    """The Engine on the embedded default model, shared by the tests that need the real model."""
    from strand.runtime.engine import Engine

    engine = Engine(dtype="float32")
    yield engine
    engine.shutdown()
