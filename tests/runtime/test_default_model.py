"""The embedded default model (SmolLM2-135M-Instruct GGUF) against transformers reading the same file."""

import os

import pytest
import torch

from strand.runtime.model_config import ModelLoadError, default_model_path
from strand.runtime.tokenizer import apply_chat_template

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "List three fruits.",
    "Explain what a CPU does in two sentences.",
    "Translate 'good morning' to Spanish.",
    "Write a short poem about rain.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def test_greedy_ids_equal_transformers_generate(default_engine, hf_model):
    tok = default_engine.tokenizer
    texts = [apply_chat_template(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    outs = default_engine.generate(prompt=texts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW})
    for text, out in zip(texts, outs):
        ids = tok.encode(text, return_tensors="pt")
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False,
                                    eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        want = ref[0, ids.shape[1]:].tolist()
        assert out["output_ids"] == want, (text, out["text"], tok.decode(want))
    assert outs[0]["text"] == "The capital of France is Paris."
    assert outs[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok.eos_token_id}


def test_bad_model_paths_name_the_problem(tmp_path):
    from strand.runtime.engine import Engine

    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(model_path=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        Engine(model_path=str(tmp_path / "empty"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match="GGUF"):
        Engine(model_path=str(bad))
    arch = tmp_path / "arch"
    arch.mkdir()
    (arch / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        Engine(model_path=str(arch))
