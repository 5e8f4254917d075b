"""Varlen attention over a paged cache, the torch reference: the new tokens of several sequences
laid end to end (FlashAttention's varlen layout, `cu_seqlens_q`), each attending to its own
sequence's keys and values read through its block table, causally.

Chapter 12's `BatchKV` regroups a step's queries into a padded `(n, H, T_max, D)` batch and gathers
every sequence's K/V up to the longest sequence, then masks the padding: its cost grows with
n · S_max whatever the sequences hold. Here sequence i reads only its own `seq_lens[i]` slots, from
the blocks its table names, and its `query_lens[i]` queries only: no padding, no mask tensor over
the batch. A chunk of a prompt (chunked prefill) is one sequence whose first `seq_lens[i] -
query_lens[i]` tokens were computed by earlier steps; a decode row is a sequence with one query.

The loop over sequences runs on the host with lengths the scheduler already knows (`query_lens`,
`seq_lens` as Python ints): no device sync. A fused kernel would run the same loop as one launch
(one program per sequence, query tile and head); this function is the reference it must match.
"""

from __future__ import annotations

import torch

from kvlib.ops.attention import reference_attention

__all__ = ["paged_prefill_attention"]


def _read(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens a block table names, `(length, H_kv, ...)`."""
    block_size = pool.shape[1]
    blocks = table[: -(-length // block_size)]
    return pool[blocks].flatten(0, 1)[:length]


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged keys and values.

    Args:
        q: (N, H, D), N = sum(query_lens): sequence i's queries are rows
            sum(query_lens[:i]) .. + query_lens[i], its last query_lens[i] tokens, in order.
        key_cache, value_cache: (num_blocks, block_size, H_kv, D) pools (H a multiple of H_kv),
            in q's dtype, or int8/fp8 codes with `k_scale`, `v_scale` (num_blocks, block_size,
            H_kv): one symmetric scale per token and KV head (the decode kernel's layout), then
            dequantized as `kvlib.quant.dequantize` does (code · scale in fp32, cast to q's dtype).
        block_tables: (n, max_blocks) integer: sequence i's blocks in order.
        query_lens, seq_lens: per sequence, its new tokens and all its tokens (the new ones
            included, so seq_lens[i] >= query_lens[i] >= 1), as Python ints.
        scale: the softmax scale (None: 1/sqrt(D)).
    Returns:
        (N, H, D) in q's dtype: query t of sequence i attends to its tokens
        0 .. seq_lens[i] - query_lens[i] + t, as `reference_attention` computes it.
    Raises:
        ValueError: lengths that do not fit q or the tables.
    """
    n = len(query_lens)
    if len(seq_lens) != n or block_tables.shape[0] != n or sum(query_lens) != q.shape[0]:
        raise ValueError(
            f"query_lens, seq_lens, block_tables: expected {n} sequences whose query_lens sum "
            f"to q's {q.shape[0]} rows, got {len(seq_lens)} seq_lens, {block_tables.shape[0]} "
            f"tables and sum {sum(query_lens)}"
        )
    capacity = block_tables.shape[1] * key_cache.shape[1]
    if any(not 1 <= t <= s <= capacity for t, s in zip(query_lens, seq_lens)):
        raise ValueError(
            f"query_lens, seq_lens: expected 1 <= query_len <= seq_len <= {capacity} (the "
            f"tables' slots), got {list(zip(query_lens, seq_lens))}"
        )
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale, v_scale: give both (a quantized cache) or neither")
    out = torch.empty_like(q)
    start = 0
    for i, (t, s) in enumerate(zip(query_lens, seq_lens)):
        table = block_tables[i]
        k, v = _read(key_cache, table, s), _read(value_cache, table, s)  # (S, H_kv, D)
        if k_scale is not None:
            k = (k.float() * _read(k_scale, table, s).float()[..., None]).to(q.dtype)
            v = (v.float() * _read(v_scale, table, s).float()[..., None]).to(q.dtype)
        query = torch.arange(s - t, s, device=q.device)  # the new tokens' indices
        mask = torch.arange(s, device=q.device)[None, :] <= query[:, None]  # (T, S)
        pair = (k.transpose(0, 1)[None], v.transpose(0, 1)[None])  # (1, H_kv, S, D)
        rows = q[start : start + t].transpose(0, 1)[None]  # (1, H, T, D)
        out[start : start + t] = reference_attention(rows, pair, mask[None], scale=scale)[
            0
        ].transpose(0, 1)
        start += t
    return out
