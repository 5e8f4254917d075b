"""Speculative decoding and the KV cache (chapter 16): a cheap drafter guesses k tokens, the target
model checks all of them in one forward over its cache (a decode step is memory-bound, so k + 1
query tokens cost about as much as one), and the cache rolls back the K/V of the tokens it rejects
(Leviathan et al., ICML 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al., 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

- `verify`: which drafted tokens the target accepts: greedy (the longest prefix equal to the
  target's argmax, plus the target's own next token) and speculative sampling (accept with
  min(1, p/q), else resample from the normalised max(0, p - q)), which keeps the target's
  distribution exactly.
- `ngram`: a drafter that needs no model: prompt lookup (the tokens that followed the latest earlier
  occurrence of the text's last n-gram; vLLM's `ngram` method takes the earliest).
- `draft_model`: a small draft model with the target's vocabulary (the course draft model: 2
  layers, d_model 64), over a cache of its own rolled back to the tokens the target emitted.
- `self_draft`: self-speculation: the target drafts over a few pages of its own cache (chapter
  15's sparse view; sinks and a window when the budget is just those), verified densely.
- `quant_draft`: self-speculation over an int4 copy of the target's cache (chapter 10's KIVI;
  QuantSpec), verified over the full-precision cache.
- `tree`: tree speculation: several candidates per position in one forward with a tree attention
  mask (SpecInfer; Medusa), the accepted branch's K/V moved into place (`move_tokens`).
- `decode`: the loop: draft, verify in one forward, keep the accepted tokens, `cache.truncate` the
  rest; greedy output token-identical to `kvlib.generation.generate`'s.

Rollback itself is each cache's `truncate(length)` (`kvlib.cache.base`): dense, static, latent,
paged, page-bounds and per-token quantized paged caches roll back; KIVI's (`QuantizedCache`) rolls
back exactly unless a flush since `length` quantized a token it keeps (always exact at R = 0 with
per-token schemes), and refuses that rollback; chapter 8's evicting cache rolls back within a
margin as `kvlib.cache.evicting_margin.MarginEvictingCache` (one decode step per token, and undo
records of its last `rollback_margin` tokens; a `ValueError` beyond them); caches that cannot undo
a write (`EvictingCache` itself, compacting caches, a wrapped ring) raise `NotImplementedError`
saying why.
"""

from kvlib.speculative.decode import Draft, SpeculationStats, speculative_generate
from kvlib.speculative.draft_model import DraftModelDrafter
from kvlib.speculative.ngram import ngram_draft
from kvlib.speculative.quant_draft import QuantizedSelfDrafter
from kvlib.speculative.self_draft import SparseSelfDrafter
from kvlib.speculative.verify import greedy_accept, residual_distribution, speculative_accept

__all__ = [
    "Draft",
    "DraftModelDrafter",
    "QuantizedSelfDrafter",
    "SparseSelfDrafter",
    "SpeculationStats",
    "greedy_accept",
    "ngram_draft",
    "residual_distribution",
    "speculative_accept",
    "speculative_generate",
]
