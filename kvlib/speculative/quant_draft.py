"""Self-speculation over a quantized cache: the target model drafts over an int4 copy of its own
cache and verifies over the full-precision one (QuantSpec, Tiwari et al., ICML 2025: "the draft
model shares the architecture of the target model but employs a hierarchical 4-bit quantized KV
cache and 4-bit quantized weights"). A draft step reads 4-bit codes plus their scales and zero
points (16-bit, one each per group of 32: with int4 KIVI 0.625 bytes per element, about 31% of a
16-bit cache's K/V bytes and 16% of float32's at long context; chapter 16 computes them) and the
keys of the group still filling, in full precision; and it is the same model, so it can guess well.

Here the copy is chapter 10's `QuantizedCache` (default: its int4 KIVI, asymmetric, keys per
channel in groups of 32 tokens, values per token in groups of 32 channels, no residual: only the
keys of the group still filling stay in full precision), kept beside the target's `DynamicCache`
or `StaticCache`:

- **catching up**: at each call the copy quantizes the tokens the target's cache gained since the
  last call, from the target's own K/V (the verification forward wrote them; nothing is
  recomputed). They are tokens the target accepted: the loop has already rolled its cache back
  past the rest;
- **drafting**: k greedy (or sampled) decode steps of the model over a **fork** of the copy, which
  is then dropped: the draft tokens' K/V were computed over quantized attention, so they are not
  the target's, and dropping the fork needs no rollback (a KIVI rollback is refused when a flush
  falls inside it). `QuantizedCache.update` replaces its tensors and never writes into them, so a
  fork is a shallow copy with lists of its own: no K/V is copied.

What it leaves out of QuantSpec: the hierarchical layout of the quantized cache that its title
names (here the int4 copy is memory on top of the full cache), the 4-bit weights (the draft runs
the target's own), and the kernels.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from kvlib.cache.dense import DynamicCache, StaticCache
from kvlib.cache.quantized import QuantizedCache
from kvlib.quant import QuantScheme
from kvlib.speculative.decode import Draft, check_temperature

__all__ = ["INT4_KIVI", "QuantizedSelfDrafter"]

INT4_KIVI = (  # chapter 10's "int4 KIVI" (Liu et al., 2024: G = 32): (key scheme, value scheme)
    QuantScheme("int4", symmetric=False, reduce="tokens", group_size=32),
    QuantScheme("int4", symmetric=False, reduce="channels", group_size=32),
)


def _read_kv(cache, layer_idx: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer_idx`'s keys and values (B, H_kv, stop - start, D) of positions start..stop-1."""
    if isinstance(cache, StaticCache):
        return tuple(cache.buffer[layer_idx, i, :, :, start:stop] for i in (0, 1))
    return cache.keys[layer_idx][:, :, start:stop], cache.values[layer_idx][:, :, start:stop]


class QuantizedSelfDrafter:
    """A drafter for `kvlib.speculative.speculative_generate`: `drafter(tokens, k)` runs k decode
    steps of `model` over a quantized copy of `cache` (see the module docstring); `cache` itself
    is only read.

    Args:
        model: the target `kvlib.model.LlamaModel`, which drafts for itself.
        cache: the full-precision `DynamicCache` or `StaticCache` the target decodes with.
        key_scheme, value_scheme: the copy's `QuantScheme`s (default `INT4_KIVI`).
        residual_length: R, the newest tokens the copy keeps in full precision (default 0).
        temperature: 0: greedy drafts (a list of ids); > 0: each draft token sampled from the
            quantized view's softmax(logits / temperature), returned as a `Draft` with those
            distributions (give the loop the same temperature).
        generator: the draws' generator (sampling only).

    Attributes:
        quantized: the copy, a `kvlib.cache.QuantizedCache` (its `nbytes` is what a draft step
            reads of the cache).

    Raises:
        TypeError: a cache that is not a `DynamicCache` or `StaticCache`; schemes as
            `QuantizedCache`'s. ValueError: as `QuantizedCache`; a negative temperature.
    """

    def __init__(
        self,
        model,
        cache,
        key_scheme: QuantScheme | None = None,
        value_scheme: QuantScheme | None = None,
        *,
        residual_length: int = 0,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ):
        if not isinstance(cache, (DynamicCache, StaticCache)):
            raise TypeError(
                f"cache: expected a DynamicCache or StaticCache (the drafter copies its K/V), got "
                f"{type(cache).__name__}"
            )
        if key_scheme is None:  # chapter 10's int4 KIVI
            key_scheme, value_scheme = INT4_KIVI[0], value_scheme or INT4_KIVI[1]
        self.quantized = QuantizedCache(
            cache.num_layers, key_scheme, value_scheme, residual_length=residual_length
        )
        check_temperature(temperature)
        self.model, self.cache = model, cache
        self.temperature, self.generator = temperature, generator

    def catch_up(self) -> int:
        """Quantize the tokens `cache` holds beyond the copy (their K/V as the target wrote them);
        returns how many. A target rolled back below the copy rolls the copy back too.

        Raises:
            NotImplementedError: that rollback, where the copy cannot make it (`truncate`).
        """
        quantized, target = self.quantized, self.cache.length
        if quantized.length > target:
            quantized.truncate(target)
        start = quantized.length
        if target > start:
            for layer_idx in range(quantized.num_layers):
                quantized.update(layer_idx, *_read_kv(self.cache, layer_idx, start, target))
            quantized.advance(target - start)
        return target - start

    def fork(self) -> QuantizedCache:
        """A copy of `quantized` that decode steps may extend without changing it: a shallow copy
        with lists of its own (`QuantizedCache.update` replaces tensors, never writes into them)."""
        view = copy.copy(self.quantized)
        for name in ("keys", "values", "residual_keys", "residual_values"):
            setattr(view, name, list(getattr(view, name)))
        return view

    def __call__(self, tokens: Sequence[int], k: int) -> list[int] | Draft:
        """k draft tokens after `tokens`, whose last token is not in the cache yet (the loop feeds
        it next); `cache` is left as it was, the copy holds the cache's tokens."""
        self.catch_up()
        view, device = self.fork(), self.model.lm_head.weight.device
        token, draft, probs = int(tokens[-1]), [], []
        with torch.no_grad():
            for _ in range(k):
                logits = self.model(torch.tensor([[token]], device=device), cache=view)
                if self.temperature:
                    row = logits[0, -1].double().cpu()  # drawn on the CPU, as the loop draws
                    probs.append(torch.softmax(row / self.temperature, -1))
                    token = int(torch.multinomial(probs[-1], 1, generator=self.generator))
                else:
                    token = int(logits[0, -1].argmax())
                draft.append(token)
        return Draft(draft, torch.stack(probs)) if self.temperature else draft
