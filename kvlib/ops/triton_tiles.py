"""The tile load both attention kernels share (`kvlib.ops.triton_decode`'s decode kernel and
`kvlib.ops.triton_prefill`'s varlen prefill kernel): a tile of BLOCK_N tokens of one KV head,
found through a sequence's block table (PagedAttention's layout, Kwon et al., 2023), and, for a
quantized cache (chapter 10), its codes converted in registers and its per-token scales loaded.

This module imports Triton (after `kvlib.ops.interpreter` has set TRITON_INTERPRET where there
is no CUDA); only the kernel modules import it.
"""

from __future__ import annotations

# isort: off
from kvlib.ops.interpreter import require_interpretable_triton

import triton
import triton.language as tl

# isort: on

require_interpretable_triton()


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # (num_blocks, block_size, H_kv, D): paged keys
    v_cache_ptr,  # (num_blocks, block_size, H_kv, D): paged values (the keys' strides)
    k_scale_ptr,  # (num_blocks, block_size, H_kv): key scales (QUANTIZED only)
    v_scale_ptr,  # (num_blocks, block_size, H_kv): value scales (QUANTIZED only)
    table_ptr,  # the sequence's row of the block table (int32 physical block ids)
    tokens,  # [BLOCK_N] logical token positions in the sequence
    token_mask,  # [BLOCK_N] which of them to load (the others read as 0)
    kv_head,  # the KV head
    dims,  # [BLOCK_D] head dimensions
    dim_mask,  # [BLOCK_D] dims < D
    q,  # the queries' tile: codes convert to its dtype
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (page)
    COMPUTE_FP32: tl.constexpr,  # K and V in fp32 (fp32 inputs, the interpreter)
    QUANTIZED: tl.constexpr,  # the pools hold int8/fp8 codes with per-token scales
):
    """(k, v, k_scale, v_scale): K and V tiles `[BLOCK_N, BLOCK_D]` in q's dtype
    (fp32 if COMPUTE_FP32) and each token's key and value scales `[BLOCK_N]` fp32
    (placeholders when not QUANTIZED: the caller applies them only when QUANTIZED)."""
    # block-table lookup: logical token -> (physical block, slot)
    physical = tl.load(table_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0)
    physical = physical.to(tl.int64)  # large caches' offsets pass 2**31 elements
    slot = tokens % BLOCK_SIZE
    # one address computation serves K and V: the same slot of the same block
    kv_offsets = (
        physical[:, None] * stride_cb
        + slot[:, None] * stride_ct
        + kv_head * stride_ch
        + dims[None, :]
    )  # [BLOCK_N, BLOCK_D]
    kv_mask = token_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    k_s = token_mask.to(tl.float32)  # placeholders when not QUANTIZED
    v_s = k_s
    if QUANTIZED:  # codes -> q's dtype in registers (exact for int8 and fp8)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        scale_offsets = physical * stride_sb + slot * stride_st + kv_head
        k_s = tl.load(k_scale_ptr + scale_offsets, mask=token_mask, other=0.0)
        v_s = tl.load(v_scale_ptr + scale_offsets, mask=token_mask, other=0.0)
        k_s = k_s.to(tl.float32)
        v_s = v_s.to(tl.float32)
    if COMPUTE_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v, k_s, v_s
