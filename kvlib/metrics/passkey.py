"""Passkey retrieval, a needle in a haystack (Mohtashami & Jaggi, 2023, Landmark Attention; used by
StreamingLLM, Xiao et al., 2024): a random number hidden at a given depth of filler text, and the
model asked for it through the chat template (chapters 5, 8 and 10). Greedy and seeded: the same
answer on every run. The sweep over lengths and depths is `kvlib.experiments.passkey`.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib._validate import check_positive_int

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def passkey_prompt(tokenizer, filler_tokens: int, depth: float, passkey: int) -> list[int]:
    """A chat prompt hiding `passkey` at relative `depth` (0 = start, 1 = end) of about
    `filler_tokens` tokens of repeated filler, then asking for it.

    Raises:
        ValueError: depth outside [0, 1], filler_tokens < 1, a passkey that is not a positive int.
    """
    check_positive_int("filler_tokens", filler_tokens)
    check_positive_int("passkey", passkey)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a number in [0, 1], got {depth!r}")
    sentence = tokenizer.encode(FILLER)
    filler = (sentence * (filler_tokens // len(sentence) + 1))[:filler_tokens]
    cut = int(round(depth * len(filler)))
    # cut at a sentence boundary, so the needle is its own sentence
    while 0 < cut < len(filler) and tokenizer.decode(filler[cut - 1 : cut]).strip() != ".":
        cut -= 1
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    text = tokenizer.decode(filler[:cut]) + needle + tokenizer.decode(filler[cut:])
    question = "There is a pass key hidden in the text above. What is the pass key?"
    messages = [{"role": "user", "content": text + "\n\n" + question}]
    return tokenizer.apply_chat_template(messages)


@torch.no_grad()
def passkey_accuracy(
    model,
    tokenizer,
    filler_tokens: int,
    depths,
    *,
    trials_per_depth: int = 1,
    seed: int = 0,
    cache_factory=None,
    max_new_tokens: int = 10,
    prefill_chunk_size: int | None = None,
) -> float:
    """Fraction of passkey trials answered correctly (greedy; the 5-digit key appears in the
    answer), over `depths` x `trials_per_depth` seeded keys.

    Args:
        cache_factory: as `kvlib.generation.generate`'s `cache` (None: a dynamic cache), to test a
            modified cache.
        prefill_chunk_size: prefill the prompt in chunks of this many tokens (an evicting cache
            then evicts while it reads the haystack, not only after it).
    """

    rng = np.random.default_rng(seed)
    results = [
        passkey_trial(
            model,
            tokenizer,
            filler_tokens,
            depth,
            int(rng.integers(10_000, 100_000)),
            cache_factory=cache_factory,
            max_new_tokens=max_new_tokens,
            prefill_chunk_size=prefill_chunk_size,
        )
        for depth in depths
        for _ in range(check_positive_int("trials_per_depth", trials_per_depth))
    ]
    return sum(correct for correct, _ in results) / len(results)


@torch.no_grad()
def passkey_trial(
    model,
    tokenizer,
    filler_tokens,
    depth,
    passkey,
    *,
    cache_factory=None,
    max_new_tokens=10,
    prefill_chunk_size=None,
) -> tuple[bool, int]:
    """One passkey trial: (whether the greedy answer contains the key, the prompt's length in
    tokens)."""
    from kvlib.generation import generate

    ids = torch.tensor([passkey_prompt(tokenizer, filler_tokens, depth, passkey)])
    out = generate(
        model,
        ids,
        max_new_tokens,
        cache=cache_factory or "dynamic",
        prefill_chunk_size=prefill_chunk_size,
    )
    return str(passkey) in tokenizer.decode(out[0, ids.shape[1] :].tolist()), ids.shape[1]
