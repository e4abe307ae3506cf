"""The one error type of the constrained-decoding package."""


class GrammarCompileError(ValueError):
    """A regex / JSON schema / choice list that cannot be compiled (or enforced exactly).

    The message names the problem: the unsupported keyword, the regex error, or the timeout."""
