"""Constrained decoding: regex / JSON schema / choices -> token-level FSM with packed masks.

Self-contained: takes a tokenizer object, imports nothing else of strand.
"""

from strand.constrained.errors import GrammarCompileError
from strand.constrained.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    accepted_prefix,
    apply_token_bitmask_,
    batch_bitmask,
    jump_forward_tokens,
    states_before,
)
from strand.constrained.tokenizer_info import TokenizerInfo

__all__ = [
    "CompiledGrammar",
    "GrammarCompileError",
    "GrammarCompiler",
    "GrammarMatcher",
    "TokenizerInfo",
    "accepted_prefix",
    "apply_token_bitmask_",
    "batch_bitmask",
    "jump_forward_tokens",
    "states_before",
]
