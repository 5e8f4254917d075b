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

import torch

from kvlib._validate import check_positive_int
from kvlib.speculative.ngram import ngram_draft
from kvlib.speculative.verify import greedy_accept

__all__ = ["SpeculationStats", "speculative_generate"]


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
    drafter: Callable[[Sequence[int], int], Sequence[int]] = ngram_draft,
) -> tuple[torch.Tensor, SpeculationStats]:
    """Greedy speculative decoding of one sequence.

    Args:
        model: a `kvlib.model.LlamaModel` (the target).
        input_ids: (1, T) int64, the prompt.
        cache: an empty cache that rolls back (`truncate`), with room for T + max_new_tokens + k
            tokens (a step writes its k draft tokens before the rejected ones are removed).
        max_new_tokens: N >= 1 tokens to emit.
        k: draft tokens per step, at most (fewer near the end, or when the drafter has fewer).
        drafter: `drafter(tokens so far, k)` -> up to k token ids (default: prompt lookup).

    Returns:
        ((1, T + N) int64 tokens, `SpeculationStats`).

    Raises:
        ValueError: input_ids not (1, T) int64; N or k not positive; a drafted id outside the
            vocabulary. NotImplementedError: a cache that cannot roll back (from `truncate`).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.dtype != torch.int64:
        raise ValueError(
            f"input_ids: expected (1, T) int64 (one sequence), got {tuple(input_ids.shape)} "
            f"{input_ids.dtype}"
        )
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    k = check_positive_int("k", k)
    vocab, device = model.config.vocab_size, input_ids.device
    stats, new = SpeculationStats(), []
    with torch.no_grad():
        next_token = int(model(input_ids, cache=cache)[0, -1].argmax())  # the prefill's token
        while True:
            new.append(next_token)
            if len(new) == max_new_tokens:
                break
            room = min(k, max_new_tokens - len(new) - 1)  # accepted + the target's token fit
            draft = [int(t) for t in drafter(input_ids[0].tolist() + new, k)][:room] if room else []
            if any(not 0 <= t < vocab for t in draft):
                raise ValueError(f"drafter: expected token ids in [0, {vocab}), got {draft}")
            step = torch.tensor([[next_token, *draft]], device=device)
            logits = model(step, cache=cache)[0]  # (1 + k', V): one forward verifies all
            accepted, next_token = greedy_accept(draft, logits)
            cache.truncate(cache.length - (len(draft) - accepted))  # the rejected tokens' K/V
            new += draft[:accepted]
            stats.num_drafts += 1
            stats.num_draft_tokens += len(draft)
            stats.num_accepted_tokens += accepted
            stats.num_emitted_tokens += accepted + 1
    tokens = torch.cat([input_ids, torch.tensor([new], device=device)], dim=1)
    return tokens, stats
