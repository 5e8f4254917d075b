"""A drafter without a model: prompt lookup (Saxena, 2023, "Prompt Lookup Decoding"; vLLM's `ngram`
speculative method). Text that repeats itself (code edits, summaries quoting their source,
retrieval answers) continues the way it continued before: find an earlier occurrence of the text's
last n tokens and propose the tokens that followed it.

Which occurrence: here the latest (the nearest context). vLLM's proposer
(`vllm/v1/spec_decode/ngram_proposer.py`) and Saxena's code take the earliest among the longest
matches; on text that repeats one phrase the two agree, on text whose continuations drift they can
propose different tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlib._validate import check_positive_int

__all__ = ["ngram_draft"]


def ngram_draft(
    tokens: Sequence[int], k: int, *, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """Up to `k` draft tokens for the text `tokens`: for n from `max_ngram` down to `min_ngram`,
    find the latest earlier occurrence of the last n tokens and return the (at most k) tokens that
    followed it; [] when no n-gram recurs (the step then verifies only the target's own token).

    Raises:
        ValueError: k, max_ngram or min_ngram not positive ints, or min_ngram > max_ngram.
    """
    k = check_positive_int("k", k)
    max_ngram = check_positive_int("max_ngram", max_ngram)
    min_ngram = check_positive_int("min_ngram", min_ngram)
    if min_ngram > max_ngram:
        raise ValueError(f"min_ngram: expected at most max_ngram = {max_ngram}, got {min_ngram}")
    tokens = list(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first, never the suffix itself
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []
