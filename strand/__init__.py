"""Strand: a structured-generation runtime and language for LLMs."""

__version__ = "0.1.0"


def __getattr__(name):
    # Heavy parts (torch, the model) load only when asked for, so `import strand` stays fast.
    if name == "Engine":
        from strand.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'strand' has no attribute {name!r}")
