"""Quantized KV caches (chapter 10): keys and values stored as `kvlib.quant` codes and scales,
dequantized next to attention.

- `QuantizedCache`: a dense cache `(B, H_kv, S, D)` per layer, in two parts: the quantized history
  and a full-precision **residual** of the most recent tokens. New tokens enter the residual; once
  it holds more than `residual_length` tokens, its oldest tokens are quantized in whole units (one
  token for per-token schemes, a group of G tokens for per-channel ones) and appended to the
  history, so the newest `residual_length` tokens always stay exact. With per-channel keys over
  groups of G = 32 tokens, per-token values in groups of 32 channels and 2 or 4 bits this is KIVI
  (Liu et al., 2024, ICML: G = 32 and R = 128 in its experiments). KIVI's code quantizes the key
  residual whenever it fills to R, so its keys' residual holds 0..R-1 tokens; here both parts keep
  at least R (between R and R + G - 1 keys).
  `requantize_history=True` instead dequantizes the whole history and quantizes it again with the
  residual each time the residual fills (what transformers' `QuantizedCache` does): O(S) work per
  flush and rounding error that accumulates; chapter 10's pitfall.
  Rollback (`truncate`, chapter 16): after L tokens, keys (and values) hold Q(L) = max(0, (L - R)
  // unit · unit) of them quantized, however the writes were split, so a rollback to `length` is
  exact when no flush happened since (Q(L) = Q(length): the rolled-back tokens are all in the
  residual) or when a cache that never saw them holds no residual (Q(length) = length: R = 0 and
  `length` a whole number of units, or 0); any other rollback raises `NotImplementedError` naming
  the positions a flush quantized. `requantize_history` never rolls back; no `move_tokens`.
- `QuantizedPagedCache`: chapter 7's paged cache with per-token codes and scales in its blocks
  (`(num_blocks, block_size, H_kv, D · bits / 8)` codes, `(num_blocks, block_size, H_kv, D / g)`
  scales), quantized as they are written through the slot mapping; chapter 11's decode kernel
  reads its int8 and fp8 pools (`kvlib.kernels.paged_decode_attention`'s `k_scale`, `v_scale`).

Attention (`quantized_attention`, `quantized_paged_attention`): dequantize to the query's dtype,
then `kvlib.ops.attention.reference_attention`, the torch reference a fused kernel must match.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import torch

from kvlib._validate import check_positive_int
from kvlib.cache.base import check_kv_append
from kvlib.cache.dense import _DenseCache
from kvlib.cache.paged import PagedCache, gather_slots, read_slots
from kvlib.ops.attention import reference_attention
from kvlib.quant import QuantizedTensor, QuantScheme, cat_quantized, dequantize, quantize

__all__ = [
    "QuantizedCache",
    "QuantizedKV",
    "QuantizedPagedCache",
    "QuantizedPagedKV",
    "quantized_attention",
    "quantized_paged_attention",
]


class QuantizedKV(NamedTuple):
    """What `QuantizedCache.update` returns for one layer: the quantized history of keys and
    values (or None) and the full-precision residuals `(B, H_kv, r, D)`; keys and values may split
    at different tokens (their schemes flush in different units)."""

    keys: QuantizedTensor | None
    values: QuantizedTensor | None
    residual_keys: torch.Tensor
    residual_values: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `(B, H_kv, S, D)` in `dtype`, history then residual."""
        parts = []
        for history, residual in (
            (self.keys, self.residual_keys),
            (self.values, self.residual_values),
        ):
            head = [] if history is None else [dequantize(history, dtype)]
            parts.append(torch.cat([*head, residual.to(dtype)], dim=2))
        return parts[0], parts[1]


def quantized_attention(q, kv: QuantizedKV, mask, *, weights_out=None, scale=None):
    """Attention over a `QuantizedCache`: dequantize keys and values to q's dtype, then
    `reference_attention`. Arguments and result as `reference_attention`'s."""
    return reference_attention(
        q, kv.dequantize(q.dtype), mask, weights_out=weights_out, scale=scale
    )


def _head(q: QuantizedTensor | None, n: int) -> QuantizedTensor | None:
    """The first `n` tokens (whole groups) of a quantized `(B, H_kv, S, D)` history; None if 0."""
    if not n or n == q.shape[2]:
        return q if n else None
    rows = n * q.scale.shape[2] // q.shape[2]  # scale rows: one per token, or per group
    zero = None if q.zero is None else q.zero[:, :, :rows]
    shape = (*q.shape[:2], n, q.shape[3])
    return QuantizedTensor(q.codes[:, :, :n], q.scale[:, :, :rows], zero, q.scheme, shape)


def _check_scheme(name: str, scheme) -> QuantScheme:
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"{name}: expected a kvlib.quant.QuantScheme, got {type(scheme).__name__}")
    return scheme


class QuantizedCache(_DenseCache):
    """A dense quantized cache with a full-precision residual (see the module docstring).

    Args:
        num_layers: L.
        key_scheme: how keys are quantized (`kvlib.quant.QuantScheme`); "channels" (per-token)
            or "tokens" (per-channel: `group_size` G tokens are quantized together once they leave
            the residual; G required).
        value_scheme: how values are; default `key_scheme`.
        residual_length: R >= 0, the newest tokens kept in full precision.
        requantize_history: transformers' way (the pitfall): when the residual exceeds R, quantize
            history and residual again as one tensor (per-channel: the whole history is one
            group). Such a cache does not roll back (`rollback_refusal`).

    `truncate(length)` is exact or refused, never approximate (see `_keep`); `move_tokens` (tree
    speculation) is not implemented and refuses.

    Raises:
        TypeError, ValueError: schemes that are not `QuantScheme`s, per-tensor schemes (a scale
        for the whole sequence is not known until it ends), per-channel schemes without a group
        size (unless `requantize_history`), a negative R. `update` raises as
        `kvlib.cache.base.check_kv_update`, and `kvlib.quant.quantize`'s errors (D not a multiple
        of the packing or of a channel group).
    """

    attention_backend = staticmethod(quantized_attention)

    def __init__(
        self,
        num_layers: int,
        key_scheme: QuantScheme,
        value_scheme: QuantScheme | None = None,
        *,
        residual_length: int = 0,
        requantize_history: bool = False,
    ):
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.key_scheme = _check_scheme("key_scheme", key_scheme)
        self.value_scheme = _check_scheme(
            "value_scheme", key_scheme if value_scheme is None else value_scheme
        )
        self.residual_length = check_positive_int(
            "residual_length", residual_length, allow_zero=True
        )
        self.requantize_history = bool(requantize_history)
        if self.requantize_history:
            self.rollback_refusal = (
                "with requantize_history=True each flush quantizes the whole history again with "
                "the residual, so rolled-back tokens may have set every scale, and when it flushes "
                "depends on how the tokens were written, not only on how many"
            )
        for name, scheme in (("key_scheme", self.key_scheme), ("value_scheme", self.value_scheme)):
            if scheme.reduce == "all":
                raise ValueError(
                    f"{name}: a per-tensor scale needs the whole sequence in advance (vLLM uses a "
                    "calibrated static scale); use reduce='channels' or 'tokens'"
                )
            if scheme.reduce == "tokens" and scheme.group_size is None and not requantize_history:
                raise ValueError(
                    f"{name}: per-channel scales over a growing cache need group_size G (tokens "
                    "quantized together once they leave the residual; KIVI uses 32)"
                )
        self.keys: list[QuantizedTensor | None] = [None] * num_layers
        self.values: list[QuantizedTensor | None] = [None] * num_layers
        self.residual_keys: list[torch.Tensor | None] = [None] * num_layers
        self.residual_values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self.requantized_tokens = 0  # K and V rows (summed over layers) quantized by requantization

    @classmethod
    def factory(cls, key_scheme, value_scheme=None, **options):
        """`generate`'s `cache=` argument: factory(model, batch_size, max_seq_len) -> a cache for
        the model's layers."""

        def make(model, batch_size, max_seq_len):
            return cls(model.config.num_hidden_layers, key_scheme, value_scheme, **options)

        return make

    def _batch_size(self) -> int:
        return 0 if self.residual_keys[0] is None else self.residual_keys[0].shape[0]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> QuantizedKV:
        """Append layer `layer_idx`'s new keys and values `(B, H_kv, T, D)` to the residual,
        quantize what leaves it, and return the layer's `QuantizedKV`."""
        old = check_kv_append(self.residual_keys, layer_idx, k, v)  # the residual (B, H_kv, r, D)
        if old is None:
            res_k, res_v = k, v
        else:
            res_k = torch.cat([old, k], dim=2)
            res_v = torch.cat([self.residual_values[layer_idx], v], dim=2)
        if self.requantize_history:
            self._requantize(layer_idx, res_k, res_v)
        else:
            self.keys[layer_idx], self.residual_keys[layer_idx] = self._flush(
                self.keys[layer_idx], res_k, self.key_scheme
            )
            self.values[layer_idx], self.residual_values[layer_idx] = self._flush(
                self.values[layer_idx], res_v, self.value_scheme
            )
        return QuantizedKV(
            self.keys[layer_idx],
            self.values[layer_idx],
            self.residual_keys[layer_idx],
            self.residual_values[layer_idx],
        )

    def _flush(self, history, residual, scheme):
        """Quantize the residual's oldest whole units beyond R; returns (history, residual)."""
        unit = scheme.group_size if scheme.reduce == "tokens" else 1
        surplus = residual.shape[2] - self.residual_length
        n = max(0, surplus // unit * unit)
        if n == 0:
            return history, residual
        new = quantize(residual[:, :, :n], scheme)
        history = new if history is None else cat_quantized([history, new])
        return history, residual[:, :, n:]

    def _requantize(self, layer_idx, res_k, res_v):
        """transformers' rule: once the residual exceeds R, history + residual are dequantized,
        concatenated and quantized again as one tensor."""
        if res_k.shape[2] <= self.residual_length:
            self.residual_keys[layer_idx], self.residual_values[layer_idx] = res_k, res_v
            return
        for store, res, scheme in (
            (self.keys, res_k, self.key_scheme),
            (self.values, res_v, self.value_scheme),
        ):
            whole = (
                res
                if store[layer_idx] is None
                else torch.cat([dequantize(store[layer_idx], res.dtype), res], dim=2)
            )
            if scheme.reduce == "tokens":  # the whole history is one group of tokens
                scheme = dataclasses.replace(scheme, group_size=None)
            store[layer_idx] = quantize(whole, scheme)
            self.requantized_tokens += whole.shape[2]
        self.residual_keys[layer_idx] = res_k[:, :, :0]
        self.residual_values[layer_idx] = res_v[:, :, :0]

    def _flush_units(self) -> tuple[int, int]:
        """Tokens per flush of keys and of values: 1 per token ("channels"), G per channel."""
        schemes = (self.key_scheme, self.value_scheme)
        return tuple(s.group_size if s.reduce == "tokens" else 1 for s in schemes)

    def _keep(self, length: int) -> None:
        """`truncate`'s cut, exact or refused before anything changes: Q(n) of n tokens are
        quantized (module docstring), so the cache cuts its history to Q(length) tokens and its
        residual to the rest when the positions Q(length)..length - 1 are still in full precision,
        as a cache that never saw the later tokens holds them.

        Raises:
            NotImplementedError: a flush since `length` quantized some of them, naming which.
        """
        R, total, cuts = self.residual_length, self.length, []
        for name, unit in zip(("keys", "values"), self._flush_units()):
            kept, flushed = (max(0, (n - R) // unit * unit) for n in (length, total))
            if kept < min(flushed, length):
                raise NotImplementedError(
                    f"{type(self).__name__} cannot roll back to length {length}: a flush since "
                    f"then quantized the {name} of positions {kept}..{min(flushed, length) - 1}, "
                    f"which a cache that never saw positions {length}..{total - 1} holds in full "
                    f"precision (the residual keeps R = {R} tokens and flushes {name} {unit} at a "
                    f"time, when the length reaches R + a multiple of {unit}). A rollback from "
                    "length L is exact only if no such flush point lies in (length, L], or if R = "
                    f"0 and length is a multiple of {unit}: speculation needs each verification "
                    "that crosses a flush point to accept all its tokens before it (always so with "
                    "R = 0 and per-token schemes); a longer residual only moves the points"
                )
            cuts.append(kept)
        parts = ((self.keys, self.residual_keys), (self.values, self.residual_values))
        for (history, residual), cut in zip(parts, cuts):
            for i, res in enumerate(residual):
                if res is not None:
                    residual[i] = res[:, :, : length - cut] if length else None
                    history[i] = _head(history[i], cut)

    def _map(self, fn) -> None:
        """Apply `fn` (a batch-axis gather) to every per-sequence tensor: codes, scales, zero
        points, residuals."""
        for layer in range(self.num_layers):
            for store in (self.keys, self.values):
                q = store[layer]
                if q is not None:
                    codes = fn(q.codes)
                    zero = None if q.zero is None else fn(q.zero)
                    shape = (codes.shape[0], *q.shape[1:])
                    store[layer] = QuantizedTensor(codes, fn(q.scale), zero, q.scheme, shape)
            for store in (self.residual_keys, self.residual_values):
                if store[layer] is not None:
                    store[layer] = fn(store[layer])

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` (B',) in that order (beam search)."""
        self._map(lambda t: t.index_select(0, indices.to(t.device)))

    def repeat(self, num_copies: int) -> QuantizedCache:
        """A new cache with each sequence copied `num_copies` times, consecutively."""
        num_copies = check_positive_int("num_copies", num_copies)
        bigger = copy.copy(self)
        for name in ("keys", "values", "residual_keys", "residual_values"):
            setattr(bigger, name, list(getattr(self, name)))
        bigger._map(lambda t: t.repeat_interleave(num_copies, dim=0))
        return bigger

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and zero points of the history, plus the residuals."""
        total = sum(q.nbytes for q in self.keys + self.values if q is not None)
        return total + sum(
            t.numel() * t.element_size()
            for t in self.residual_keys + self.residual_values
            if t is not None
        )


class QuantizedPagedKV(NamedTuple):
    """What `QuantizedPagedCache.update` returns for one layer: `PagedKV`'s fields with code pools
    as `key_cache`, `value_cache`, plus the scale pools `(num_blocks, block_size, H_kv, D / g)`,
    the zero-point pools (None: symmetric) and the schemes."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor | None
    key_scale: torch.Tensor
    value_scale: torch.Tensor
    key_zero: torch.Tensor | None
    value_zero: torch.Tensor | None
    key_scheme: QuantScheme
    value_scheme: QuantScheme


def _gather(codes, scale, zero, scheme, slots, head_dim) -> QuantizedTensor:
    """The `(B, H_kv, S, D)` quantized tensor the slots (B, S) read from a pool."""

    def read(pool):
        return gather_slots(pool, slots).transpose(1, 2)  # (B, H_kv, S, ...)

    c = read(codes)
    shape = (*c.shape[:-1], head_dim)
    return QuantizedTensor(c, read(scale), None if zero is None else read(zero), scheme, shape)


def quantized_paged_attention(q, kv: QuantizedPagedKV, mask, *, weights_out=None, scale=None):
    """Attention over a `QuantizedPagedCache`, the torch reference: gather codes and scales
    through the block tables, dequantize to q's dtype, `reference_attention`. Arguments and result
    as `kvlib.cache.paged.paged_attention`'s."""
    slots = read_slots(kv)
    head_dim = q.shape[-1]
    keys = _gather(kv.key_cache, kv.key_scale, kv.key_zero, kv.key_scheme, slots, head_dim)
    values = _gather(
        kv.value_cache, kv.value_scale, kv.value_zero, kv.value_scheme, slots, head_dim
    )
    pair = (dequantize(keys, q.dtype), dequantize(values, q.dtype))
    return reference_attention(q, pair, mask, weights_out=weights_out, scale=scale)


class QuantizedPagedCache(PagedCache):
    """Chapter 7's paged cache storing per-token quantized keys and values (see the module
    docstring). Arguments as `PagedCache`'s (`dtype`: the model's, which keys and values arrive
    and are dequantized in), plus:

    Args:
        key_scheme, value_scheme: `QuantScheme`s with reduce="channels" (per token, optionally in
            groups of channels); value_scheme defaults to key_scheme.

    Raises:
        TypeError, ValueError: schemes that are not per-token (a block's tokens arrive one at a
        time, so a per-channel scale over them is not known when the first is written: use
        `QuantizedCache`'s residual); a head dimension the scheme cannot pack or group.
    """

    attention_backend = staticmethod(quantized_paged_attention)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        key_scheme: QuantScheme,
        value_scheme: QuantScheme | None = None,
        **paged,
    ):
        self.key_scheme = _check_scheme("key_scheme", key_scheme)
        self.value_scheme = _check_scheme(
            "value_scheme", key_scheme if value_scheme is None else value_scheme
        )
        for name, scheme in (("key_scheme", self.key_scheme), ("value_scheme", self.value_scheme)):
            if scheme.reduce != "channels":
                raise ValueError(
                    f"{name}: a paged cache quantizes each token as it is written, so scales "
                    f"must be per token (reduce='channels'), got {scheme.granularity}"
                )
        super().__init__(num_layers, num_kv_heads, head_dim, **paged)

    def _make_pools(self, num_blocks: int, device: torch.device) -> None:
        """Per layer: codes `(num_blocks, block_size, H_kv, D · bits / 8)`, scales (and zero points)
        `(num_blocks, block_size, H_kv, D / g)`, in the dtypes `quantize` produces."""
        for name, scheme in (("key", self.key_scheme), ("value", self.value_scheme)):
            probe = quantize(torch.zeros(1, self.num_kv_heads, self.head_dim), scheme)
            shape = (num_blocks, self.block_size, self.num_kv_heads)

            def pools(like):
                return [
                    like.new_zeros(*shape, like.shape[-1], device=device)
                    for _ in range(self.num_layers)
                ]

            setattr(self, f"{name}_cache", pools(probe.codes))
            setattr(self, f"{name}_scale", pools(probe.scale))
            setattr(self, f"{name}_zero", None if probe.zero is None else pools(probe.zero))

    def _write(self, layer_idx, slots, new_k, new_v, handle):
        """Quantize the step's tokens (N, H_kv, D), one scale per token and head (and channel
        group), and store codes and scales at `slots`."""
        for new, codes, scale, zero, scheme in (
            (new_k, self.key_cache, self.key_scale, self.key_zero, self.key_scheme),
            (new_v, self.value_cache, self.value_scale, self.value_zero, self.value_scheme),
        ):
            if new.shape[0] == 0:  # every sequence's step was padding
                continue
            q = quantize(new, scheme)  # (N, H_kv, D): per token and head
            codes[layer_idx].flatten(0, 1)[slots] = q.codes
            scale[layer_idx].flatten(0, 1)[slots] = q.scale
            if zero is not None:
                zero[layer_idx].flatten(0, 1)[slots] = q.zero
        return QuantizedPagedKV(
            self.key_cache[layer_idx],
            self.value_cache[layer_idx],
            handle.block_tables,
            handle.seq_lens,
            handle.positions,
            self.key_scale[layer_idx],
            self.value_scale[layer_idx],
            None if self.key_zero is None else self.key_zero[layer_idx],
            None if self.value_zero is None else self.value_zero[layer_idx],
            self.key_scheme,
            self.value_scheme,
        )

    def _pools(self) -> list[torch.Tensor]:
        pools = self.key_cache + self.value_cache + self.key_scale + self.value_scale
        return pools + (self.key_zero or []) + (self.value_zero or [])
