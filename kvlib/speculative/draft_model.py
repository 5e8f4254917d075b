"""Drafting with a small model: a draft model with the target's vocabulary guesses k tokens, one
cheap decode step each, over its own KV cache (Leviathan et al., ICML 2023; Chen et al., 2023;
vLLM's `draft_model` speculative method). For the course model the draft is `kvlib.loaders.
course_draft.load_course_draft_model()`: 2 layers of d_model 64, about 1/7 of the target's
parameters.

The draft model keeps a cache of its own (a `kvlib.cache.DynamicCache`), which must follow the
tokens the target emits. Each call compares the tokens so far with the ones the draft cache holds,
rolls the cache back (`truncate`) to their longest common prefix (the drafted tokens the target
rejected go; those it accepted stay), feeds the tokens the cache lacks in one forward (the
catch-up: the last emitted token, the target's own token after a rejection or a full acceptance,
the whole prompt on the first call) and then one token per draft step. The draft steps' K/V stay
in the draft cache: they are the draft model's exact K/V for those tokens whatever follows
(attention is causal), so when the target accepts a drafted token its K/V is already there, and
when it rejects one the next call's rollback removes it. The k-th drafted token is never fed (no
draft follows it): a call runs k forwards of the draft model, the catch-up included.

What it does not do: batches (one sequence, as `speculative_generate`), a draft model with
another vocabulary or tokenizer, or sharing the target's cache (the two models' K/V differ in
layers and width).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlib._validate import check_positive_int
from kvlib.speculative.decode import Draft, check_temperature

__all__ = ["DraftModelDrafter"]


class DraftModelDrafter:
    """A drafter for `kvlib.speculative.speculative_generate`: `drafter(tokens, k)` returns the
    draft model's next k tokens after `tokens`, greedy (a list of ids) or sampled (a `Draft`).

    State: `cache`, the draft model's `DynamicCache` (per layer K/V (1, H_kv, S, D) in the draft
    model's dtype, float32 for the course draft), and `cached_tokens`, the S token ids whose K/V it
    holds, in order (always a prefix of the last call's tokens followed by the drafted tokens but
    the last). `num_forwards` counts the draft model's forwards since creation.

    Args:
        draft_model: the draft `kvlib.model.LlamaModel` (eval mode).
        target: the target model (anything with `config.vocab_size`): its vocabulary must be the
            draft's, so that a drafted id means the same token to both.
        temperature: 0: greedy drafts (a list of k ids); > 0: each drafted token is drawn from the
            draft model's softmax(logits / temperature) in float64 on the CPU, and returned as a
            `Draft` whose `probs` (k, V) float64 are those distributions (give
            `speculative_generate` the same temperature).
        generator: the draws' generator (sampling only; a CPU generator).

    Raises:
        ValueError: a draft model whose vocab_size differs from the target's, naming both; a
            negative temperature.
        TypeError: a draft_model or target without a `config.vocab_size`.
    """

    def __init__(
        self,
        draft_model,
        target,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        from kvlib.cache import DynamicCache

        for name, model in (("draft_model", draft_model), ("target", target)):
            if not isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int):
                raise TypeError(
                    f"{name}: expected a model with config.vocab_size, got {type(model).__name__}"
                )
        if draft_model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft_model: expected the target's vocab_size {target.config.vocab_size}, got "
                f"{draft_model.config.vocab_size}"
            )
        self.temperature = check_temperature(temperature)
        self.model, self.generator = draft_model, generator
        self.cache = DynamicCache(draft_model.config.num_hidden_layers)
        self.cached_tokens: list[int] = []
        self.num_forwards = 0

    def __call__(self, tokens: Sequence[int], k: int) -> list[int] | Draft:
        """k draft tokens after `tokens` (the prompt and every token emitted so far).

        Raises:
            ValueError: `tokens` empty; k not a positive int (TypeError if not an int).
        """
        k = check_positive_int("k", k)
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("tokens: expected at least one token id, got none")
        # the longest prefix of `tokens` the cache holds, less at least one token to feed
        held = 0
        for cached, token in zip(self.cached_tokens, tokens[:-1]):
            if cached != token:
                break
            held += 1
        self.cache.truncate(held)  # the rejected drafts' K/V (and any other divergence)
        del self.cached_tokens[held:]
        device = self.model.lm_head.weight.device
        feed, draft, probs = tokens[held:], [], []
        with torch.no_grad():
            for _ in range(k):
                ids = torch.tensor([feed], device=device)  # (1, T): catch-up, then T = 1
                logits = self.model(ids, cache=self.cache)[0, -1]  # (V,)
                self.cached_tokens += feed
                self.num_forwards += 1
                if self.temperature:
                    row = torch.softmax(logits.double().cpu() / self.temperature, dim=-1)  # (V,)
                    probs.append(row)
                    token = int(torch.multinomial(row, 1, generator=self.generator))
                else:
                    token = int(logits.argmax())
                draft.append(token)
                feed = [token]
        return Draft(draft, torch.stack(probs)) if self.temperature else draft  # probs: (k, V)
