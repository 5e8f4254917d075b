"""The Triton kernels of `kvlib.kernels.paged_decode_attention`: a split-K paged decode-attention
kernel and the kernel that merges its splits (the design is described in `kvlib.kernels`).

Learned sinks (gpt-oss; `HAS_SINKS`) join the softmax once, where the splits are merged: in the
reduce, as one more partial (output 0, log-sum-exp = the sink), or in the split kernel when one
split is the whole sequence (`SINGLE_SPLIT`: it is its own merge). A split never adds the sink to
its own partial: k splits would count it k times (`kvlib.ref.online_softmax.merge_partials`).

This module imports Triton; `kvlib.kernels` imports it only when a kernel is launched, so the rest
of the package (and the reference) works where Triton does not install (macOS, native Windows).
"""

from __future__ import annotations

# Triton decorates its own helpers (tl.cdiv, tl.max, ...) when first imported, and reads
# TRITON_INTERPRET then: kvlib.ops.interpreter sets it (without CUDA) before `import triton`.
# isort: off
from kvlib.ops.interpreter import require_interpretable_triton
from kvlib.ops.triton_tiles import load_kv_tile

import triton
import triton.language as tl

# isort: on

require_interpretable_triton()


@triton.jit
def _decode_split_kernel(
    q_ptr,  # (B, H, D): one query per sequence and head
    k_cache_ptr,  # (num_blocks, block_size, H_kv, D): paged keys
    v_cache_ptr,  # (num_blocks, block_size, H_kv, D): paged values
    k_scale_ptr,  # (num_blocks, block_size, H_kv): per-token key scales (QUANTIZED only)
    v_scale_ptr,  # (num_blocks, block_size, H_kv): per-token value scales (QUANTIZED only)
    block_tables_ptr,  # (B, max_blocks_per_seq) int32: physical block of each logical block
    seq_lens_ptr,  # (B,) int32: tokens in each sequence
    partial_out_ptr,  # (B, H, num_splits, D) fp32: each split's normalised output
    partial_lse_ptr,  # (B, H, num_splits) fp32: each split's log2-sum-exp2 of its scores
    out_ptr,  # (B, H, D) in q's dtype: the result, written here when SINGLE_SPLIT
    sinks_ptr,  # (H,) fp32: learned sink logits, in the units of the scaled scores (HAS_SINKS)
    qk_scale,  # softmax scale * log2(e): scores come out in the log2 domain
    stride_qb,
    stride_qh,
    stride_cb,  # k_cache and v_cache share strides (checked by the wrapper)
    stride_ct,
    stride_ch,
    stride_sb,  # k_scale and v_scale share strides; their last one is 1
    stride_st,
    stride_bt_b,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    num_splits,
    GROUP_SIZE: tl.constexpr,  # G = H / H_kv query heads per KV head
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (page)
    BLOCK_G: tl.constexpr,  # G padded to a power of two >= 16 (the rows of tl.dot)
    BLOCK_D: tl.constexpr,  # D padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # tokens per tile: a power of two >= 16, a multiple of BLOCK_SIZE
    COMPUTE_FP32: tl.constexpr,  # cast K/V to fp32 before the dots (fp32 inputs, the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 dots (not TF32's 10-bit mantissa), else "tf32"
    QUANTIZED: tl.constexpr,  # K/V pools hold int8/fp8 codes with per-token scales
    SINGLE_SPLIT: tl.constexpr,  # one split: write the output itself, no partials, no reduce
    HAS_SINKS: tl.constexpr,  # learned sinks: added here if SINGLE_SPLIT, else in the reduce
):
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # --- this split's token range [start, end), aligned to whole tiles ---
    seq_len = tl.load(seq_lens_ptr + batch)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    # --- the GQA group's queries: [BLOCK_G, BLOCK_D] ---
    group = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP_SIZE + group
    group_mask = group < GROUP_SIZE
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + batch * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=group_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if COMPUTE_FP32:
        q = q.to(tl.float32)

    # --- running state of the online softmax, per query head ---
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)  # running denominator
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)  # unnormalised output

    offsets = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + offsets  # [BLOCK_N]
        token_mask = tokens < end
        k, v, k_s, v_s = load_kv_tile(  # via the block table (ops/triton_tiles)
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            block_tables_ptr + batch * stride_bt_b,
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

        # --- scores in the log2 domain, masked past the end: [BLOCK_G, BLOCK_N] ---
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if QUANTIZED:
            scores = scores * k_s[None, :]  # each key's scale scales its score column
        scores = tl.where(token_mask[None, :], scores, float("-inf"))

        # --- online softmax update (chapter 4), with exp2 ---
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)  # rescales what was accumulated against the old max
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if QUANTIZED:
            p = p * v_s[None, :]  # each value's scale folded into its probability
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # --- this split's partial result; an empty split writes lse = -inf (weight 0 in the reduce) ---
    has_tokens = l > 0
    out = acc / tl.where(has_tokens, l, 1.0)[:, None]
    if SINGLE_SPLIT:  # the whole sequence in one split: this is the result (what the reduce gives)
        if HAS_SINKS:  # this split is also the merge: the sink joins the denominator, once
            sink = tl.load(sinks_ptr + heads, mask=group_mask, other=0.0) * 1.4426950408889634
            # acc / (l + 2^(sink - m)) = out · l' / (l' + 2^(sink - top)), l' = l · 2^(m - top):
            # [BLOCK_G], both exponents <= 0 (log2 domain: sink · log2(e))
            top = tl.maximum(m, sink)
            kept = l * tl.exp2(m - top)
            out = out * (kept / (kept + tl.exp2(sink - top)))[:, None]
        result_ptrs = out_ptr + batch * stride_outb + heads[:, None] * stride_outh + dims[None, :]
        tl.store(
            result_ptrs,
            out.to(out_ptr.dtype.element_ty),
            mask=group_mask[:, None] & dim_mask[None, :],
        )
    else:
        lse = tl.where(has_tokens, m + tl.log2(tl.where(has_tokens, l, 1.0)), float("-inf"))
        out_ptrs = (
            partial_out_ptr
            + batch * stride_ob
            + heads[:, None] * stride_oh
            + split * stride_os
            + dims[None, :]
        )
        tl.store(out_ptrs, out, mask=group_mask[:, None] & dim_mask[None, :])
        lse_ptrs = partial_lse_ptr + batch * stride_lb + heads * stride_lh + split
        tl.store(lse_ptrs, lse, mask=group_mask)


@triton.jit
def _reduce_splits_kernel(
    partial_out_ptr,  # (B, H, num_splits, D) fp32
    partial_lse_ptr,  # (B, H, num_splits) fp32, log2 domain
    out_ptr,  # (B, H, D) in q's dtype
    sinks_ptr,  # (H,) fp32: learned sink logits, in the units of the scaled scores (HAS_SINKS)
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,  # the sink joins here, once: one more partial, out 0, lse = sink
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    dim_mask = dims < HEAD_DIM

    # --- weights exp2(lse_i - max lse): each split's share of the softmax denominator ---
    lse = tl.load(
        partial_lse_ptr + batch * stride_lb + head * stride_lh + splits,
        mask=split_mask,
        other=float("-inf"),
    )
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 domain: sink · log2(e)
        top = tl.maximum(top, sink)
    weights = tl.exp2(lse - top)  # [BLOCK_S]; 0 for empty splits
    partial = tl.load(
        partial_out_ptr
        + batch * stride_ob
        + head * stride_oh
        + splits[:, None] * stride_os
        + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]

    # --- the exact merge ---
    denominator = tl.sum(weights, axis=0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - top)  # the sink's share: once, whatever num_splits
    out = tl.sum(weights[:, None] * partial, axis=0) / denominator
    tl.store(
        out_ptr + batch * stride_outb + head * stride_outh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )
