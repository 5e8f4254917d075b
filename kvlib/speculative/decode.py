"""The speculative decoding loop for one sequence: draft k tokens, verify them with one forward of
the target model over its cache, keep the accepted ones, roll the cache back past the rest.

Each step feeds `[last token, *draft]` (k + 1 query tokens) through the model, which writes their
K/V into the cache; `verify.greedy_accept` says how many draft tokens stand, and
`cache.truncate` removes the K/V of the rejected ones, so the cache holds exactly the tokens
emitted so far but the newest (which the next step feeds). Greedy output is token-identical to
`kvlib.generation.generate`'s greedy output; only the number of forwards changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvlib._validate import check_positive_int
from kvlib.speculative.ngram import ngram_draft
from kvlib.speculative.verify import greedy_accept, speculative_accept

__all__ = ["Draft", "SpeculationStats", "speculative_generate"]


class Draft(NamedTuple):
    """A drafter's guess with the distributions it was sampled from: `tokens` (k ids) and `probs`
    (k, V), row i the q_i that token i was drawn from (at the temperature the target samples
    with: speculative sampling's output is the target's only if q is what the draft really
    used)."""

    tokens: list[int]
    probs: torch.Tensor


@dataclasses.dataclass
class SpeculationStats:
    """Counts over a speculative run (vLLM's `spec_decode` counters: drafts, draft tokens,
    accepted tokens), and the tokens emitted."""

    num_drafts: int = 0  # verification forwards (steps)
    num_draft_tokens: int = 0  # tokens the drafter proposed
    num_accepted_tokens: int = 0  # of them, accepted
    num_emitted_tokens: int = 0  # accepted + the target's own token, per step (not the prefill's)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per drafted token, in [0, 1] (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification forward, in [1, k + 1]."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0


def speculative_generate(
    model,
    input_ids: torch.Tensor,
    cache,
    *,
    max_new_tokens: int,
    k: int = 4,
    drafter: Callable[[Sequence[int], int], Sequence[int] | Draft] = ngram_draft,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, SpeculationStats]:
    """Speculative decoding of one sequence: greedy (temperature 0) or sampled.

    Args:
        model: a `kvlib.model.LlamaModel` (the target).
        input_ids: (1, T) int64, the prompt.
        cache: an empty cache that rolls back (`truncate`), with room for T + max_new_tokens - 1
            tokens (the newest token is never fed; a step asks for no more draft tokens than
            still fit, so its verification stays within that, and so do the draft steps of a
            drafter that writes to the cache, as `SparseSelfDrafter` does).
        max_new_tokens: N >= 1 tokens to emit.
        k: draft tokens per step, at most (fewer near the end, or when the drafter has fewer).
        drafter: `drafter(tokens so far, k)` -> up to k token ids, a deterministic guess (its
            distribution q is one-hot: prompt lookup, the default), or a `Draft` with the (k, V)
            distributions its tokens were sampled from.
        temperature: 0: greedy, token-identical to greedy decoding; > 0: the target samples from
            softmax(logits / temperature), through `verify.speculative_accept`, so the tokens are
            distributed as plain sampling's at that temperature.
        generator: the request's generator for every draw (sampling only).

    Returns:
        ((1, T + N) int64 tokens, `SpeculationStats`).

    Raises:
        ValueError: input_ids not (1, T) int64; N or k not positive; a negative temperature; a
            drafted id outside the vocabulary. NotImplementedError: a cache that cannot roll back
            (from `truncate`).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.dtype != torch.int64:
        raise ValueError(
            f"input_ids: expected (1, T) int64 (one sequence), got {tuple(input_ids.shape)} "
            f"{input_ids.dtype}"
        )
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    k = check_positive_int("k", k)
    check_temperature(temperature)
    vocab, device = model.config.vocab_size, input_ids.device

    def probs(logits):  # the target's distributions at this temperature, in float64
        return torch.softmax(logits.double() / temperature, dim=-1)

    stats, new = SpeculationStats(), []
    with torch.no_grad():
        last = model(input_ids, cache=cache)[0, -1]  # the prefill's token
        if temperature:  # drawn on the CPU, as `speculative_accept` draws
            next_token = int(torch.multinomial(probs(last).cpu(), 1, generator=generator))
        else:
            next_token = int(last.argmax())
        while True:
            new.append(next_token)
            if len(new) == max_new_tokens:
                break
            room = min(k, max_new_tokens - len(new) - 1)  # accepted + the target's token fit
            proposed = drafter(input_ids[0].tolist() + new, room) if room else []
            guess = _draft_tokens(proposed, room, vocab)
            step = torch.tensor([[next_token, *guess]], device=device)
            logits = model(step, cache=cache)[0]  # (1 + k', V): one forward verifies all
            if temperature:
                q = _draft_probs(proposed, guess, vocab)
                accepted, next_token = speculative_accept(guess, q, probs(logits), generator)
            else:
                accepted, next_token = greedy_accept(guess, logits)
            cache.truncate(cache.length - (len(guess) - accepted))  # the rejected tokens' K/V
            new += guess[:accepted]
            stats.num_drafts += 1
            stats.num_draft_tokens += len(guess)
            stats.num_accepted_tokens += accepted
            stats.num_emitted_tokens += accepted + 1
    tokens = torch.cat([input_ids, torch.tensor([new], device=device)], dim=1)
    return tokens, stats


def check_temperature(temperature) -> float:
    """`temperature` if it is a number >= 0 (0: greedy).

    Raises:
        ValueError: anything else (NaN included), naming the argument.
    """
    if not temperature >= 0:
        raise ValueError(f"temperature: expected a number >= 0, got {temperature!r}")
    return temperature


def _draft_tokens(proposed, room: int, vocab: int) -> list[int]:
    """A drafter's answer (ids, or a `Draft`) as at most `room` token ids.

    Raises:
        ValueError: an id outside [0, vocab).
    """
    tokens = [int(t) for t in (proposed.tokens if isinstance(proposed, Draft) else proposed)]
    if any(not 0 <= t < vocab for t in tokens):
        raise ValueError(f"drafter: expected token ids in [0, {vocab}), got {tokens}")
    return tokens[:room]


def _draft_probs(proposed, guess: list[int], vocab: int) -> torch.Tensor:
    """(len(guess), V) q rows of the tokens kept: a `Draft`'s own, else one-hot (a deterministic
    drafter puts all its probability on its guess)."""
    if isinstance(proposed, Draft):
        return proposed.probs[: len(guess)]
    one_hot = torch.zeros(len(guess), vocab, dtype=torch.float64)
    one_hot[torch.arange(len(guess)), guess] = 1.0
    return one_hot
