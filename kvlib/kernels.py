"""A paged, GQA-aware, split-K decode-attention kernel in Triton, with its reference beside it.

What it does: one decode step of attention for B sequences whose keys and values live in a paged
cache (PagedAttention's layout, Kwon et al., 2023): `k_cache, v_cache (num_blocks, block_size,
H_kv, D)`, a block table per sequence, and each sequence's length. Design, after the fastest public
decode kernels (Flash-Decoding, Dao et al., 2023; vLLM's and FlashInfer's decode kernels):

- one program per (sequence, KV head, split): the G = H / H_kv query heads that share a KV head
  are the rows of one tile, so each K/V byte is read once per KV head, not once per query head;
- split-K over the sequence: each split streams its share of the tokens with the online-softmax
  recurrence (chapter 4) and writes an fp32 partial output and its log-sum-exp; a second kernel
  merges the splits;
- `exp2` with the softmax scale and log2(e) folded into one multiplier;
- block-table lookups inside the kernel: token t of sequence b lives in physical block
  `block_tables[b, t // block_size]`, slot `t % block_size`.

- quantized caches (chapter 10): with `k_scale`, `v_scale` the pools hold int8 or fp8 codes with
  one scale per token and KV head (`kvlib.cache.QuantizedPagedCache`'s symmetric per-token
  layout). The kernel loads the codes, converts them to the query's dtype in registers and applies
  the scales where they cost least: a key's scale multiplies its score column, a value's scale its
  probability, so `q·(s_k k)ᵀ = s_k (q·kᵀ)` and `p (s_v v) = (p s_v) v` with no dequantized K/V
  tile ever written.

What it does not do: prefill (T > 1 queries per sequence), write the cache, or zero points
(asymmetric codes) and channel-grouped scales.

On a machine without CUDA, importing this module sets `TRITON_INTERPRET=1` before any kernel is
decorated, so the kernels run (slowly, exactly) on the CPU under Triton's interpreter. Under the
interpreter all arithmetic is done in fp32 (it mishandles bf16 arithmetic).
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # must happen before the @triton.jit decorators below run
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LOG2_E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # codes with scales


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
        # --- block-table lookup: logical token -> (physical block, slot) ---
        tokens = tile_start + offsets  # [BLOCK_N]
        token_mask = tokens < end
        physical = tl.load(
            block_tables_ptr + batch * stride_bt_b + tokens // BLOCK_SIZE, mask=token_mask, other=0
        )
        physical = physical.to(tl.int64)  # block offsets of large caches pass 2**31 elements
        slot = tokens % BLOCK_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        # one address computation serves K and V: the same slot of the same block in each pool
        kv_offsets = (
            physical[:, None] * stride_cb
            + slot[:, None] * stride_ct
            + kv_head * stride_ch
            + dims[None, :]
        )  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if QUANTIZED:  # codes -> q's dtype in registers (exact: int8 and fp8 fit in fp16/bf16)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            scale_offsets = physical * stride_sb + slot * stride_st + kv_head
            k_s = tl.load(k_scale_ptr + scale_offsets, mask=token_mask, other=0.0).to(tl.float32)
            v_s = tl.load(v_scale_ptr + scale_offsets, mask=token_mask, other=0.0).to(tl.float32)
        if COMPUTE_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

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
    lse = tl.where(has_tokens, m + tl.log2(tl.where(has_tokens, l, 1.0)), float("-inf"))
    out_ptrs = (
        partial_out_ptr
        + batch * stride_ob
        + heads[:, None] * stride_oh
        + split * stride_os
        + dims[None, :]
    )
    tl.store(out_ptrs, out, mask=group_mask[:, None] & dim_mask[None, :])
    tl.store(partial_lse_ptr + batch * stride_lb + heads * stride_lh + split, lse, mask=group_mask)


@triton.jit
def _reduce_splits_kernel(
    partial_out_ptr,  # (B, H, num_splits, D) fp32
    partial_lse_ptr,  # (B, H, num_splits) fp32, log2 domain
    out_ptr,  # (B, H, D) in q's dtype
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
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + batch * stride_outb + head * stride_outh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def _check_inputs(
    q, k_cache, v_cache, block_tables, seq_lens, validate: bool, k_scale=None, v_scale=None
) -> tuple[int, int, int, int]:
    """Validate before launch; returns (B, H, H_kv, D)."""
    for name, tensor in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q: expected (B, H, D), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache, v_cache: expected equal shapes (num_blocks, block_size, H_kv, D), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"k_cache: expected head dim D = {head_dim} (from q), got {cache_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q: H = {num_heads} query heads must be a multiple of H_kv = {num_kv_heads} KV heads"
        )
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale, v_scale: expected both (a quantized cache) or neither")
    if k_scale is not None:
        _check_scales(q, k_cache, v_cache, k_scale, v_scale)
    elif q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(
            "q, k_cache, v_cache: expected one dtype among float32/float16/bfloat16, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError(
            f"block_tables, seq_lens: expected int32, got {block_tables.dtype} and {seq_lens.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables: expected ({batch}, max_blocks_per_seq), got {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens: expected ({batch},), got {tuple(seq_lens.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(
            "q, k_cache, v_cache, block_tables, seq_lens: expected one device, got "
            f"{sorted(map(str, devices))}"
        )
    if block_size & (block_size - 1) or block_size < 1:
        raise ValueError(f"k_cache: expected a power-of-two block_size, got {block_size}")
    if (
        q.stride(-1) != 1
        or k_cache.stride(-1) != 1
        or v_cache.stride(-1) != 1
        or block_tables.stride(-1) != 1
    ):
        raise ValueError(
            "q, k_cache, v_cache, block_tables: expected a contiguous last dimension (stride 1)"
        )
    if k_cache.stride() != v_cache.stride():  # the kernel computes one address for both
        raise ValueError(
            f"k_cache, v_cache: expected the same strides, got {k_cache.stride()} and "
            f"{v_cache.stride()}"
        )
    if validate:  # one host sync for all value checks
        capacity = block_tables.shape[1] * block_size
        lengths_ok, blocks_low, blocks_high = torch.stack(
            [
                ((seq_lens >= 1) & (seq_lens <= capacity)).all(),
                (block_tables >= 0).all() | (block_tables.numel() == 0),
                (block_tables < num_blocks).all() | (block_tables.numel() == 0),
            ]
        ).tolist()
        if not lengths_ok:
            raise ValueError(
                f"seq_lens: expected every length in [1, {capacity}] (block table capacity), got "
                f"{seq_lens.tolist()}"
            )
        if not (blocks_low and blocks_high):
            raise ValueError(
                f"block_tables: expected block ids in [0, {num_blocks}), got min "
                f"{int(block_tables.min())}, max {int(block_tables.max())}"
            )
    return batch, num_heads, num_kv_heads, head_dim


def _check_scales(q, k_cache, v_cache, k_scale, v_scale) -> None:
    """A quantized cache: int8/fp8 codes of one dtype, and per-token scales (num_blocks,
    block_size, H_kv) float16/float32, contiguous, on the cache's device."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q: expected float32/float16/bfloat16, got {q.dtype}")
    if k_cache.dtype not in QUANTIZED_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"k_cache, v_cache: with scales, expected codes of one dtype among {QUANTIZED_DTYPES}, "
            f"got {k_cache.dtype} and {v_cache.dtype}"
        )
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(scale).__name__}")
        if scale.shape != k_cache.shape[:3] or not scale.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous (num_blocks, block_size, H_kv) = "
                f"{tuple(k_cache.shape[:3])} tensor, one scale per token and KV head, got "
                f"{tuple(scale.shape)}"
            )
        if scale.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"{name}: expected float16 or float32, got {scale.dtype}")
        if scale.device != k_cache.device:
            raise ValueError(f"{name}: expected device {k_cache.device}, got {scale.device}")
    if k_scale.dtype != v_scale.dtype:
        raise TypeError(
            f"k_scale, v_scale: expected one dtype, got {k_scale.dtype}, {v_scale.dtype}"
        )


# Launch options frozen from the H100 sweep in results/decode_tuning.csv (`python -m
# kvlib.course.bench tune`, 7 split counts x 3 BLOCK_N x 2 num_warps x 2 num_stages on 12
# shapes): at each shape's best split count, this one setting was within 5% of that shape's
# fastest configuration on all twelve. Frozen, not autotuned at run time, so every run (and the
# CPU interpreter) is repeatable.
GPU_LAUNCH = {"block_n": 32, "num_warps": 4, "num_stages": 3}


def default_num_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Split count that fills the device's SMs (`ops.launch.choose_num_splits`); 1 on CPU."""
    from kvlib.ops.launch import choose_num_splits

    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return choose_num_splits(batch_size, num_kv_heads, max_seq_len, num_sms=num_sms)


def paged_decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale=None,
    num_splits=None,
    validate=True,
    block_n=None,
    num_warps=None,
    num_stages=None,
    k_scale=None,
    v_scale=None,
):
    """Decode attention over a paged KV cache (one new query per sequence and head).

    Args:
        q: (B, H, D) float32 / float16 / bfloat16.
        k_cache, v_cache: (num_blocks, block_size, H_kv, D), q's dtype, the same strides; block_size
            a power of two. With scales: int8, float8_e4m3fn or float8_e5m2 codes.
        block_tables: (B, max_blocks_per_seq) int32; row b lists sequence b's physical blocks.
        seq_lens: (B,) int32, each in [1, max_blocks_per_seq * block_size].
        scale: softmax scale, default D ** -0.5.
        num_splits: split-K factor; default fills the GPU's SMs (`default_num_splits`).
        validate: check lengths and block ids on the device first (one host sync).
        block_n: tokens per tile: a power of two >= 16 and a multiple of block_size; default
            max(block_size, 32) on a GPU (`GPU_LAUNCH`), max(block_size, 64) in the interpreter.
        num_warps, num_stages: Triton launch options of the split kernel; default `GPU_LAUNCH`'s
            on a GPU (the interpreter ignores them).
        k_scale, v_scale: (num_blocks, block_size, H_kv) float16/float32, contiguous: a quantized
            cache's per-token symmetric scales (`x = scale · code`), both or neither.
    Returns:
        (B, H, D) in q's dtype; accumulation in fp32.
    Raises:
        TypeError, ValueError: inputs that disagree in shape, dtype or device, H not a multiple
        of H_kv, lengths beyond the block table, block ids outside the cache.
    """
    batch, num_heads, num_kv_heads, head_dim = _check_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, validate, k_scale, v_scale
    )
    block_size = k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    quantized = k_scale is not None
    scale = head_dim**-0.5 if scale is None else float(scale)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, int(seq_lens.max()), q.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1, got {num_splits!r}")
    on_gpu = q.device.type == "cuda" and not INTERPRETED
    if block_n is None:
        block_n = max(block_size, GPU_LAUNCH["block_n"] if on_gpu else 64)
    if on_gpu:
        num_warps = GPU_LAUNCH["num_warps"] if num_warps is None else num_warps
        num_stages = GPU_LAUNCH["num_stages"] if num_stages is None else num_stages
    if (
        not isinstance(block_n, int)
        or block_n < 16
        or block_n & (block_n - 1)
        or block_n % block_size
    ):
        # tl.arange needs a power of two; tl.dot on a GPU needs every dimension >= 16
        raise ValueError(
            f"block_n: expected a power of two >= 16 and a multiple of block_size {block_size}, "
            f"got {block_n!r}"
        )

    partial_out = torch.empty(
        batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    # tl.dot's K dimension on a GPU is >= 16; masks cover the padding
    block_d = max(16, triton.next_power_of_2(head_dim))
    compute_fp32 = INTERPRETED or q.dtype == torch.float32
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scale if quantized else k_cache,  # unused pointers when not quantized
        v_scale if quantized else v_cache,
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scale.stride(0) if quantized else 0,
        k_scale.stride(1) if quantized else 0,
        block_tables.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        num_splits,
        GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        COMPUTE_FP32=compute_fp32,
        # fp32 dots in IEEE fp32: a GPU's default TF32 keeps 10 mantissa bits and misses rtol 1e-5.
        # (For bf16/fp16 inputs "tf32" is the default and changes nothing.)
        DOT_PRECISION="ieee" if compute_fp32 else "tf32",
        QUANTIZED=quantized,
        **{
            option: value
            for option, value in (("num_warps", num_warps), ("num_stages", num_stages))
            if value is not None
        },
    )
    _reduce_splits_kernel[(batch, num_heads)](
        partial_out,
        partial_lse,
        out,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )
    return out


def paged_decode_attention_ref(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale=None,
    validate=True,
    k_scale=None,
    v_scale=None,
    **launch_options,
):
    """Reference for `paged_decode_attention`, same arguments: gather each sequence's K/V through
    its block table (dequantized, `scale · code`, when scales are given), repeat KV heads for their
    query groups, and attend in fp32 with plain torch (the kernel's launch options, `num_splits`,
    `block_n`, `num_warps`, `num_stages`, are accepted and change nothing here).

    Returns (B, H, D) in q's dtype.
    """
    batch, num_heads, num_kv_heads, head_dim = _check_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, validate, k_scale, v_scale
    )
    if k_scale is not None:
        k_cache = k_cache.float() * k_scale.float()[..., None]
        v_cache = v_cache.float() * v_scale.float()[..., None]
    block_size = k_cache.shape[1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    out = torch.empty_like(q)
    for b in range(batch):
        length = int(seq_lens[b])
        blocks = block_tables[b, : math.ceil(length / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()  # (S, H_kv, D)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (S, H, D)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,shd->hs", q[b].float(), k) * scale  # (H, S)
        out[b] = torch.einsum("hs,shd->hd", scores.softmax(dim=-1), v).to(q.dtype)  # (H, D)
    return out
