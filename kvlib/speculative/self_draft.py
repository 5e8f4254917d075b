"""Self-speculation: the target model drafts for itself over a sparse view of its own cache, and
verifies over the full cache (TriForce, Sun et al., 2024; MagicDec, Sadhukhan et al., ICLR 2025: at
long context a decode step's cost is the cache it reads, so a draft that reads a few pages is
cheap, and it is the same model, so it guesses well).

Here the view is chapter 15's `kvlib.sparse.SparsePagedCache`: a draft step is a decode step that
reads `budget_pages` pages per sequence and layer (Quest's bound picks them; with a budget of just
`sink_pages + recent_pages` it is chapter 8's attention sinks plus a recent window, at page
granularity). The draft steps write their K/V into the same cache; those K/V were computed with
sparse attention, so they are not the target's, and the drafter rolls them back (`truncate`)
before the verification forward, which feeds `[last token, *draft]` as one chunk and so attends
densely (the cache attends chunks densely), writing the target's exact K/V.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlib._validate import check_positive_int
from kvlib.speculative.decode import Draft, check_temperature

__all__ = ["SparseSelfDrafter"]


class SparseSelfDrafter:
    """A drafter for `kvlib.speculative.speculative_generate`: `drafter(tokens, k)` runs k greedy
    decode steps of `model` over `cache` with `budget_pages` pages read per step, then rolls the
    cache back to where it was.

    Args:
        model: the target `kvlib.model.LlamaModel`, which drafts for itself.
        cache: the `kvlib.sparse.SparsePagedCache` the target decodes with (its `budget_pages`
            must be None outside the draft steps: the verification reads every page).
        budget_pages: pages a draft step reads per sequence and sparse layer.
        temperature: 0: greedy drafts (a list of ids); > 0: each draft token sampled from the
            sparse view's softmax(logits / temperature), returned as a `Draft` with those
            distributions (give the loop the same temperature).
        generator: the draws' generator (sampling only).

    Raises:
        ValueError: `budget_pages` not a positive int, or below the cache's forced pages; a cache
            whose `budget_pages` is already set.
        TypeError: a cache without `budget_pages` (not a sparse cache).
    """

    def __init__(
        self,
        model,
        cache,
        budget_pages: int,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        if not hasattr(cache, "budget_pages"):
            raise TypeError(
                f"cache: expected a kvlib.sparse.SparsePagedCache, got {type(cache).__name__}"
            )
        if cache.budget_pages is not None:
            raise ValueError(
                f"cache: expected budget_pages None (the verification reads every page), got "
                f"{cache.budget_pages}"
            )
        check_positive_int("budget_pages", budget_pages)
        forced = cache.sink_pages + cache.recent_pages
        if budget_pages < forced:
            raise ValueError(
                f"budget_pages: expected at least sink_pages + recent_pages = {forced}, got "
                f"{budget_pages}"
            )
        check_temperature(temperature)
        self.model, self.cache, self.budget_pages = model, cache, budget_pages
        self.temperature, self.generator = temperature, generator

    def __call__(self, tokens: Sequence[int], k: int) -> list[int] | Draft:
        """k draft tokens after `tokens`, whose last token is not in the cache yet (the loop feeds
        it next); the cache is left as it was."""
        cache, start = self.cache, self.cache.length
        device = self.model.lm_head.weight.device
        token, draft, probs = int(tokens[-1]), [], []
        cache.budget_pages = self.budget_pages
        try:
            with torch.no_grad():
                for _ in range(k):
                    logits = self.model(torch.tensor([[token]], device=device), cache=cache)
                    if self.temperature:
                        row = logits[0, -1].double().cpu()  # drawn on the CPU, as the loop draws
                        probs.append(torch.softmax(row / self.temperature, -1))
                        token = int(torch.multinomial(probs[-1], 1, generator=self.generator))
                    else:
                        token = int(logits[0, -1].argmax())
                    draft.append(token)
        finally:
            cache.budget_pages = None
            cache.truncate(start)  # the draft steps' sparse K/V: not the target's
        return Draft(draft, torch.stack(probs)) if self.temperature else draft
