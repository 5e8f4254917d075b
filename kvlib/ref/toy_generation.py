"""Naive and cached generation with the toy decoder (chapter 1): greedy decoding that either
re-encodes the whole sequence every step or encodes only the new token against a `ToyKVCache`,
recording each step's logits and work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvlib._validate import check_array, check_positive_int
from kvlib.ref.op_counts import OpCounts
from kvlib.ref.toy_cache import ToyKVCache
from kvlib.ref.toy_model import ToyModel


@dataclass
class GenerationTrace:
    """What a generation loop produced: the tokens, each step's logits and each step's work.

    tokens: (P + N,) the prompt followed by N generated ids.
    logits: (N, V) the logits each new token was chosen from.
    step_counts: N `OpCounts`, one per forward pass.
    """

    tokens: np.ndarray
    logits: np.ndarray
    step_counts: list[OpCounts] = field(default_factory=list)

    @property
    def total_counts(self) -> OpCounts:
        return sum(self.step_counts, OpCounts())


def _check_generation_args(model: ToyModel, prompt_ids: np.ndarray, max_new_tokens: int) -> int:
    if not isinstance(model, ToyModel):
        raise TypeError(f"model: expected a ToyModel, got {type(model).__name__}")
    check_array("prompt_ids", prompt_ids, ndim=1, integer=True)
    if prompt_ids.size == 0:
        raise ValueError("prompt_ids: expected at least one token, got an empty prompt")
    return check_positive_int("max_new_tokens", max_new_tokens)


def generate_naive(model: ToyModel, prompt_ids: np.ndarray, max_new_tokens: int) -> GenerationTrace:
    """Greedy generation without a cache: every step re-encodes the whole prefix.

    Step i runs `model.forward` on all P + i tokens and keeps only the last row of logits, so the
    work per step grows as O(n^2) score entries in the prefix length n, O(n^3) per sequence.

    Args:
        model: a ToyModel.
        prompt_ids: (P,) ints.
        max_new_tokens: N >= 1.
    Returns:
        A GenerationTrace with tokens (P + N,), logits (N, V) and N step counts.
    """
    n = _check_generation_args(model, prompt_ids, max_new_tokens)
    tokens = list(prompt_ids)
    all_logits, step_counts = [], []
    for _ in range(n):
        counts = OpCounts()
        logits = model.forward(np.array(tokens), counts=counts)[-1]  # (V,): last position only
        tokens.append(int(np.argmax(logits)))
        all_logits.append(logits)
        step_counts.append(counts)
    return GenerationTrace(np.array(tokens), np.stack(all_logits), step_counts)


def generate_cached(
    model: ToyModel, prompt_ids: np.ndarray, max_new_tokens: int, cache: ToyKVCache | None = None
) -> GenerationTrace:
    """Greedy generation with a KV cache: prefill the prompt once, then feed one token per step.

    Step 0 (prefill) encodes the P prompt tokens and fills the cache; each later step encodes only
    the newest token, appends one K and one V row per layer and attends over the cache: O(n)
    score entries per step, O(n^2) per sequence.

    Args:
        model: a ToyModel.
        prompt_ids: (P,) ints.
        max_new_tokens: N >= 1.
        cache: an empty ToyKVCache to fill (for inspection afterwards); default: a new one of P + N
            rows.
    Returns:
        A GenerationTrace with tokens (P + N,), logits (N, V) and N step counts.
    Raises:
        ValueError: `cache` is not empty. CacheOverflowError: it is too small.
    """
    n = _check_generation_args(model, prompt_ids, max_new_tokens)
    if cache is None:
        cache = model.new_cache(prompt_ids.shape[0] + n)
    elif cache.length:
        raise ValueError(
            f"cache: expected an empty cache, got one holding {cache.length} tokens (reusing a "
            "cache across prompts mixes them)"
        )
    tokens = list(prompt_ids)
    all_logits, step_counts = [], []
    next_input = np.array(tokens)  # prefill: the whole prompt
    for _ in range(n):
        counts = OpCounts()
        logits = model.forward(next_input, cache=cache, counts=counts)[-1]  # (V,)
        tokens.append(int(np.argmax(logits)))
        all_logits.append(logits)
        step_counts.append(counts)
        next_input = np.array(tokens[-1:])  # decode: only the newest token
    return GenerationTrace(np.array(tokens), np.stack(all_logits), step_counts)
