"""Loading the tokenizer (from a HF folder or a GGUF file) and applying the chat template."""

from __future__ import annotations

import functools
import os

from strand.runtime.model_config import ModelLoadError, is_gguf, resolve_model_path


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_path: str | None = None):
    """A transformers fast tokenizer for the model; the chat template comes with it."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model_path)
    try:
        if is_gguf(path):
            tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        else:
            tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types here
        raise ModelLoadError(f"tokenizer: cannot load from {path!r}: {e}") from None
    return tok


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if not getattr(tokenizer, "chat_template", None):
        # A plain fallback for models without a template.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def eos_token_ids(tokenizer, extra: list[int] | None = None) -> set[int]:
    ids = set(extra or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
