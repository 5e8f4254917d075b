"""The Triton kernel of `kvlib.ops.varlen_attention.varlen_paged_attention`: causal attention of
a step's new tokens, several sequences laid end to end (`cu_seqlens_q`), each over its own paged
keys and values, in one launch (the design is described in `kvlib.ops.varlen_attention`).

This module imports Triton; `kvlib.ops.varlen_attention` imports it only when the kernel is
launched, so the rest of the package works where Triton does not install.
"""

from __future__ import annotations

# Triton reads TRITON_INTERPRET when first imported: kvlib.ops.interpreter sets it (without CUDA)
# before `import triton`, as for the decode kernel.
# isort: off
from kvlib.ops.interpreter import require_interpretable_triton
from kvlib.ops.triton_tiles import load_kv_tile

import triton
import triton.language as tl

# isort: on

require_interpretable_triton()


@triton.jit
def _varlen_paged_attention_kernel(
    q_ptr,  # (N, H, D): the step's queries, sequence after sequence
    k_cache_ptr,  # (num_blocks, block_size, H_kv, D): paged keys (this step's already written)
    v_cache_ptr,  # (num_blocks, block_size, H_kv, D): paged values
    k_scale_ptr,  # (num_blocks, block_size, H_kv): per-token key scales (QUANTIZED only)
    v_scale_ptr,  # (num_blocks, block_size, H_kv): per-token value scales (QUANTIZED only)
    block_tables_ptr,  # (n, max_blocks) int32: each sequence's physical blocks in order
    cu_seqlens_q_ptr,  # (n + 1,) int32: sequence i's queries are rows cu[i] .. cu[i + 1] - 1
    seq_lens_ptr,  # (n,) int32: tokens each sequence holds, this step's included
    out_ptr,  # (N, H, D) in q's dtype
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_cb,  # k_cache and v_cache share strides
    stride_ct,
    stride_ch,
    stride_sb,  # k_scale and v_scale share strides; their last one is 1
    stride_st,
    stride_bt_b,
    stride_ot,
    stride_oh,
    GROUP_SIZE: tl.constexpr,  # G = H / H_kv: query head h reads KV head h // G
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (page)
    BLOCK_M: tl.constexpr,  # queries per tile: a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per tile: a power of two >= 16, a multiple of BLOCK_SIZE
    BLOCK_D: tl.constexpr,  # D padded to a power of two >= 16
    COMPUTE_FP32: tl.constexpr,  # cast to fp32 before the dots (fp32 inputs, the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 dots, else "tf32"
    QUANTIZED: tl.constexpr,  # K/V pools hold int8/fp8 codes with per-token scales
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)

    # --- this program's queries: rows [tile * BLOCK_M, +BLOCK_M) of sequence `seq` ---
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= query_len:  # the grid covers the longest sequence: nothing here
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - query_len  # tokens cached before this step
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the sequence
    row_mask = rows < query_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if COMPUTE_FP32:
        q = q.to(tl.float32)
    kv_head = head // GROUP_SIZE

    # --- online softmax over the keys the tile's last query sees (causal) ---
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last_key = context + tl.minimum((tile + 1) * BLOCK_M, query_len)  # one past the last visible
    offsets = tl.arange(0, BLOCK_N)
    for key_start in range(0, last_key, BLOCK_N):
        tokens = key_start + offsets  # [BLOCK_N]
        token_mask = tokens < last_key
        k, v, k_s, v_s = load_kv_tile(  # via the block table (ops/triton_tiles)
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            block_tables_ptr + seq * stride_bt_b,
            tokens,
            token_mask,
            kv_head,
            dims,
            dim_mask,
            q,
            stride_cb,
            stride_ct,
            stride_ch,
            stride_sb,
            stride_st,
            BLOCK_SIZE,
            COMPUTE_FP32,
            QUANTIZED,
        )

        # --- scores [BLOCK_M, BLOCK_N], log2 domain; query r sees keys 0 .. context + r ---
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if QUANTIZED:
            scores = scores * k_s[None, :]
        visible = (tokens[None, :] <= context + rows[:, None]) & token_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        # --- online softmax update (chapter 4); a row with nothing visible yet stays at -inf ---
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if QUANTIZED:
            p = p * v_s[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # --- normalise and store the tile's real rows ---
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )
