"""Varlen paged attention in one launch (issue 48, part 3): a step's new tokens, several sequences
laid end to end, each attending causally to its own keys and values in a paged cache.

The inputs follow the **cu_seqlens convention** of FlashAttention's varlen API (vLLM calls it
`query_start_loc`): `q (N, H, D)` holds every sequence's new queries end to end, and
`cu_seqlens_q (n + 1,)` says where each sequence's rows start (`cu_seqlens_q[0] = 0`,
`cu_seqlens_q[n] = N`); `seq_lens (n,)` counts the tokens each sequence holds after the step (its
cached prefix plus its new tokens, whose K/V the caller has already written), and
`block_tables (n, max_blocks)` names its blocks. A prompt, a chunk of a prompt after cached
tokens (chunked prefill, a prefix-cache hit) and a decode row (one query) are all the same case:
query r of sequence i, its token `seq_lens[i] - query_len_i + r`, sees the sequence's tokens up
to itself.

`kvlib.ops.paged_prefill.paged_prefill_attention` is the reference (a Python loop over the
sequences, a few torch launches each); `varlen_paged_attention` runs the kernel of
`kvlib.ops.triton_prefill`: one program per (sequence, tile of `BLOCK_M` queries, query head),
streaming the sequence's keys and values through the block table up to what the tile's last
query sees, with the online softmax (chapter 4) in fp32 and `exp2` with the scale folded in, a
row mask for causality. Query heads of one KV head each read that head's keys and values (the
decode kernel reads them once per group): prefill is compute-bound, and a tile's rows are one
head's tokens. Quantized pools (int8/fp8 codes, one scale per token and KV head) are read as the
decode kernel reads them.

The grid is (n, ceil(max_query_len / BLOCK_M), H), with `max_query_len` known on the host (the
scheduler's); tiles past a sequence's queries return at once, so a caller that captures the launch
in a CUDA graph passes an upper bound instead and every replay launches the same grid.
"""

from __future__ import annotations

import torch

from kvlib.ops.decode_checks import SUPPORTED_DTYPES, check_scales
from kvlib.ops.decode_plan import LOG2_E, next_power_of_2
from kvlib.ops.interpreter import INTERPRETED
from kvlib.ops.paged_prefill import paged_prefill_attention
from kvlib.ops.triton_import import import_triton_module

__all__ = ["varlen_paged_attention", "varlen_paged_attention_ref"]

BLOCK_M = 16  # queries per tile (tl.dot's rows: >= 16 on a GPU)
BLOCK_N = 32  # keys per tile


def _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale):
    """Shapes, dtypes and devices (metadata only: no host sync)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q),
                    ("seq_lens", seq_lens)):  # fmt: skip
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q, k_cache, v_cache: expected (N, H, D) and two (num_blocks, block_size, H_kv, D), "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    heads, dim = q.shape[1:]
    num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != dim or heads % kv_heads or block_size & (block_size - 1):
        raise ValueError(
            f"k_cache: expected head dim {dim}, a number of KV heads dividing {heads} and a "
            f"power-of-two block size, got {tuple(k_cache.shape)}"
        )
    if k_scale is not None or v_scale is not None:
        check_scales(q, k_cache, v_cache, k_scale, v_scale)
    elif q.dtype not in SUPPORTED_DTYPES or {k_cache.dtype, v_cache.dtype} != {q.dtype}:
        raise TypeError(
            f"q, k_cache, v_cache: expected one dtype among float32/float16/bfloat16, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    n = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if (
        n < 1
        or cu_seqlens_q.shape != (n + 1,)
        or block_tables.dim() != 2
        or block_tables.shape[0] != n
        or {block_tables.dtype, cu_seqlens_q.dtype, seq_lens.dtype} != {torch.int32}
    ):
        raise ValueError(
            f"block_tables, cu_seqlens_q, seq_lens: expected int32 (n, max_blocks), (n + 1,) and "
            f"(n,) for n >= 1 sequences, got {tuple(block_tables.shape)} {block_tables.dtype}, "
            f"{tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}, {tuple(seq_lens.shape)} "
            f"{seq_lens.dtype}"
        )
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"q, k_cache, ...: expected one device, got {sorted(map(str, devices))}")
    if not INTERPRETED and q.device.type != "cuda":
        raise ValueError(
            f"q: the kernel is compiled for CUDA here (TRITON_INTERPRET is not 1), so the inputs "
            f"must be on a CUDA device, got {q.device}; use varlen_paged_attention_ref on the CPU"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q, k_cache, v_cache: expected a contiguous last dimension, K and V alike")
    return heads, kv_heads, dim, block_size


def varlen_paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    *,
    max_query_len: int,
    scale: float | None = None,
    k_scale=None,
    v_scale=None,
    out=None,
):
    """Causal varlen attention over a paged cache, one Triton launch (see the module docstring).

    Args:
        q: (N, H, D) float32/float16/bfloat16, sequence i's queries in rows
            cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1.
        k_cache, v_cache: (num_blocks, block_size, H_kv, D) in q's dtype (or int8/fp8 codes
            with `k_scale`, `v_scale` (num_blocks, block_size, H_kv) float16/float32), the step's
            K/V already written.
        block_tables: (n, max_blocks) int32. cu_seqlens_q: (n + 1,) int32. seq_lens: (n,) int32,
            each >= its query count.
        max_query_len: the most queries any sequence has (or an upper bound): sizes the grid.
        scale: the softmax scale (None: D ** -0.5). out: an (N, H, D) tensor to write into.
    Returns:
        (N, H, D) in q's dtype (`out` if given), fp32 accumulation.
    Raises:
        TypeError, ValueError: inputs of the wrong shape, dtype or device, naming them.
        TritonUnavailableError: Triton cannot be imported (use `varlen_paged_attention_ref`).
    """
    heads, kv_heads, dim, block_size = _check(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale
    )
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"max_query_len: expected an int >= 1, got {max_query_len!r}")
    module = import_triton_module(
        "kvlib.ops.triton_prefill", "varlen_paged_attention", "kvlib.ops.varlen_attention"
    )
    kernel = module._varlen_paged_attention_kernel
    if out is None:
        out = torch.empty_like(q)
    quantized = k_scale is not None
    compute_fp32 = INTERPRETED or q.dtype == torch.float32
    qk_scale = (dim**-0.5 if scale is None else float(scale)) * LOG2_E
    grid = (seq_lens.shape[0], -(-max_query_len // BLOCK_M), heads)
    kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scale if quantized else k_cache,  # unused pointers when not quantized
        v_scale if quantized else v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        qk_scale,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *(k_scale.stride()[:2] if quantized else (0, 0)),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP_SIZE=heads // kv_heads,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=max(BLOCK_N, block_size),
        BLOCK_D=max(16, next_power_of_2(dim)),
        COMPUTE_FP32=compute_fp32,
        DOT_PRECISION="ieee" if compute_fp32 else "tf32",
        QUANTIZED=quantized,
    )
    return out


def varlen_paged_attention_ref(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    *,
    max_query_len: int,
    scale: float | None = None,
    k_scale=None,
    v_scale=None,
    out=None,
):
    """Reference for `varlen_paged_attention`, same arguments (`max_query_len` unused):
    `paged_prefill_attention` with the lengths brought to the host."""
    starts = cu_seqlens_q.tolist()
    result = paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_tables.long(),
        [b - a for a, b in zip(starts, starts[1:])],
        seq_lens.tolist(),
        k_scale=k_scale,
        v_scale=v_scale,
        scale=scale,
    )
    if out is None:
        return result
    out.copy_(result)
    return out
