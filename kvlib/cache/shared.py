"""Cross-layer KV sharing (chapter 17): some layers store no K/V and attend over the cache an
earlier layer wrote in the same forward.

Cross-Layer Attention (Brandon et al., 2024, "Reducing Transformer Key-Value Cache Size with
Cross-Layer Attention") trains a model in which groups of adjacent layers share one set of keys
and values: only the first layer of a group projects and stores K/V, the others read them.
Gemma 3n configures it as `num_kv_shared_layers`: each of the last layers reads the cache of the
last layer of its own kind (full or sliding) before the sharing starts, which is how chapter 3's
`kvlib.memory.layer_specs` counts it (kind "shared", no bytes, `LayerSpec.reads` naming the
producer); transformers' Gemma 3n skips the shared layers' K/V projections when it has a cache
(`Gemma3nTextAttention`'s `kv_shared_layer_index`, transformers commit b87ecf8c).

`CrossLayerCache` does this behind the cache interface, without changing the model: an inner cache
holds the **producer** layers only (its `num_layers` is their count), a producer's `update` is the
inner cache's `update` of its inner index, and a **consumer**'s `update` stores nothing and returns
what its producer's `update` returned in this forward (the producer runs first: it is an earlier
layer). The consumer's own `k` and `v` (kvlib's layers compute them) are dropped; a model trained
with sharing has no such projections, and one that was not (the course model, SmolLM2) changes
its outputs, which is why CLA is trained in, not switched on (chapter 17 measures what it costs an
untrained model). Bytes: the inner cache's, (L - shared) / L of the unshared cache.

What it does not do: sharing within a layer's heads (that is GQA, chapter 5), sharing between
layers of different geometry (the producer's K/V must be what the consumer's attention reads),
caches that decide positions or rotate keys on read (`EvictingCache`: refused, its
`query_positions` and `rotates_keys` would not reach the model), or skipping the consumers' K/V
projections (the model computes them; a CLA model has none). `begin_forward` is passed to the
inner cache; the dense and static inner caches are the tested ones.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from kvlib._validate import check_positive_int

__all__ = ["CrossLayerCache", "reads_from_specs"]


def reads_from_specs(specs) -> dict[int, int]:
    """{consumer layer: producer layer} from `kvlib.memory.layer_specs(config)` (the "shared"
    layers' `reads`), the mapping `CrossLayerCache` takes."""
    return {s.index: s.reads for s in specs if s.kind == "shared"}


class CrossLayerCache:
    """A cache in which the layers of `reads` read an earlier layer's K/V (module docstring).

    Args:
        inner: the cache of the producer layers, `inner.num_layers` = num_layers - len(reads);
            producer i of the model (in layer order) is the inner cache's layer i.
        num_layers: L, the model's layers.
        reads: {consumer: producer}, each producer an earlier layer that is not a consumer.

    Raises:
        ValueError: a layer index outside [0, num_layers), a producer that is not earlier than
            its consumer or is itself a consumer, an inner cache of the wrong number of layers
            or one that decides positions (`query_positions`, `rotates_keys`: `EvictingCache`).
        RuntimeError (at `update`): a consumer whose producer has not written in this forward.
    """

    def __init__(self, inner, num_layers: int, reads: Mapping[int, int]):
        self.num_layers = check_positive_int("num_layers", num_layers)
        reads = dict(reads)
        for consumer, producer in reads.items():
            if type(consumer) is not int or not 0 <= consumer < num_layers:
                raise ValueError(
                    f"reads: consumer layers must be in [0, {num_layers}), got {consumer!r}"
                )
            if type(producer) is not int or not 0 <= producer < consumer:
                raise ValueError(
                    f"reads: layer {consumer} must read an earlier layer, got {producer!r}"
                )
            if producer in reads:
                raise ValueError(
                    f"reads: layer {consumer} reads layer {producer}, which stores nothing itself"
                )
        for hook in ("query_positions", "rotates_keys"):  # positions the cache decides
            if hasattr(inner, hook):
                raise ValueError(
                    f"inner: a cache that defines {hook} ({type(inner).__name__}) is not supported"
                )
        producers = [i for i in range(num_layers) if i not in reads]
        if getattr(inner, "num_layers", None) != len(producers):
            raise ValueError(
                f"inner: needs one layer per producer ({len(producers)} of {num_layers}), "
                f"got num_layers={getattr(inner, 'num_layers', None)!r}"
            )
        self.inner, self.reads = inner, reads
        self.inner_index = {layer: i for i, layer in enumerate(producers)}
        self._written: dict[int, object] = {}  # producer -> what its update returned this forward

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.inner.seq_lens

    @property
    def nbytes(self) -> int:
        """The producers' K/V bytes: all this cache stores."""
        return self.inner.nbytes

    @property
    def attention_backend(self):
        return self.inner.attention_backend  # AttributeError if the inner cache has none

    def begin_forward(self, num_tokens: int, attention_mask) -> None:
        self._written.clear()
        if hasattr(self.inner, "begin_forward"):
            self.inner.begin_forward(num_tokens, attention_mask)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """A producer's update: stored in the inner cache, returned as it returns it. A
        consumer's: nothing stored, its producer's result of this forward returned."""
        if layer_idx in self.reads:
            producer = self.reads[layer_idx]
            if producer not in self._written:
                raise RuntimeError(
                    f"layer {layer_idx} reads layer {producer}'s K/V, which has not been written "
                    "in this forward"
                )
            return self._written[producer]
        if layer_idx not in self.inner_index:
            raise ValueError(f"layer_idx: must be in [0, {self.num_layers}), got {layer_idx!r}")
        out = self.inner.update(self.inner_index[layer_idx], k, v)
        self._written[layer_idx] = out
        return out

    def advance(self, num_tokens: int) -> None:
        self._written.clear()
        self.inner.advance(num_tokens)

    def reorder(self, indices: torch.Tensor) -> None:
        self.inner.reorder(indices)

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)

    def repeat(self, num_copies: int) -> CrossLayerCache:
        bigger = copy.copy(self)
        bigger.inner, bigger._written = self.inner.repeat(num_copies), {}
        return bigger
