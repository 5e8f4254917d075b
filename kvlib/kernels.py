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

Triton itself is imported only when a kernel is launched (the kernels live in
`kvlib.ops.triton_decode`): where Triton does not install (macOS, native Windows) this module, its
checks and `paged_decode_attention_ref` work, and `paged_decode_attention` raises
`TritonUnavailableError` naming what to use instead.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # must happen before any @triton.jit decorator runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LOG2_E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # codes with scales
_KERNEL_NAMES = ("_decode_split_kernel", "_reduce_splits_kernel")  # in kvlib.ops.triton_decode


class TritonUnavailableError(ImportError):
    """A Triton kernel was launched where Triton cannot be imported (macOS, native Windows, or
    not installed)."""


def triton_available() -> bool:
    """Whether Triton can be imported here (it installs on Linux, and on Windows inside WSL2)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_kernels():
    """The module holding the @triton.jit kernels, imported on first launch.

    Raises:
        TritonUnavailableError: Triton is not importable here (the message says what to do).
    """
    try:
        from kvlib.ops import triton_decode
    except ImportError as error:
        if error.name is None or error.name.split(".")[0] != "triton":
            raise  # a broken kvlib, not a missing Triton
        raise TritonUnavailableError(
            f"paged_decode_attention launches a Triton kernel, and Triton cannot be imported here "
            f"({error}). Triton runs on Linux (on Windows, inside WSL2): `pip install triton` "
            "(without a CUDA GPU, kvlib.kernels runs it under Triton's CPU interpreter). Without "
            "Triton, use kvlib.kernels.paged_decode_attention_ref: the same arguments and result, "
            "in plain torch."
        ) from error
    return triton_decode


def __getattr__(name: str):
    """`kvlib.kernels._decode_split_kernel` and `_reduce_splits_kernel`, loaded (with Triton) on
    first use, so that importing this module never needs Triton."""
    if name in _KERNEL_NAMES:
        return getattr(_triton_kernels(), name)
    raise AttributeError(f"module 'kvlib.kernels' has no attribute {name!r}")


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length()


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
    block_d = max(16, _next_power_of_2(head_dim))
    compute_fp32 = INTERPRETED or q.dtype == torch.float32
    kernels = _triton_kernels()  # raises TritonUnavailableError where Triton is missing
    kernels._decode_split_kernel[(batch, num_kv_heads, num_splits)](
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
        BLOCK_G=max(16, _next_power_of_2(group_size)),
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
    kernels._reduce_splits_kernel[(batch, num_heads)](
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
        BLOCK_S=_next_power_of_2(num_splits),
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
