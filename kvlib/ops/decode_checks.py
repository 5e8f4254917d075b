"""The checks of the paged decode-attention wrapper (`kvlib.kernels.paged_decode_attention`) and of
its reference: shapes, dtypes, devices and strides from metadata alone (`check_inputs`, no host
sync: run once per distinct metadata by `kvlib.ops.decode_plan`), the values of block tables and
sequence lengths (`check_values`: a host sync, only with `validate=True`), the scales of a
quantized cache (`check_scales`) and learned sinks (`check_sinks`). Each error names the
argument, what was expected and what was given."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # codes with scales


def check_inputs(
    q, k_cache, v_cache, block_tables, seq_lens, k_scale=None, v_scale=None
) -> tuple[int, int, int, int]:
    """Check shapes, dtypes, devices and strides (metadata: no host sync); returns
    (B, H, H_kv, D)."""
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
    if batch < 1:
        raise ValueError(f"q: expected at least one sequence, got shape {tuple(q.shape)}")
    if cache_dim != head_dim:
        raise ValueError(f"k_cache: expected head dim D = {head_dim} (from q), got {cache_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q: H = {num_heads} query heads must be a multiple of H_kv = {num_kv_heads} KV heads"
        )
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale, v_scale: expected both (a quantized cache) or neither")
    if k_scale is not None:
        check_scales(q, k_cache, v_cache, k_scale, v_scale)
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
    return batch, num_heads, num_kv_heads, head_dim


def check_values(block_tables, seq_lens, num_blocks: int, block_size: int) -> int:
    """Check lengths and block ids on their device with one host sync; returns the longest
    length (so that choosing a split count costs no second sync)."""
    capacity = block_tables.shape[1] * block_size
    lengths_ok, blocks_low, blocks_high, longest = torch.stack(
        [
            ((seq_lens >= 1) & (seq_lens <= capacity)).all().long(),
            (block_tables >= 0).all().long(),  # True for an empty table
            (block_tables < num_blocks).all().long(),
            seq_lens.max().long(),
        ]
    ).tolist()  # the one sync
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
    return longest


def check_sinks(q, sinks) -> None:
    """Learned sinks (gpt-oss): None, or a contiguous (H,) float32 tensor on q's device, one logit
    per query head in the units of the scaled scores (metadata only: no host sync)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32:
        raise TypeError(
            f"sinks: expected a float32 (H,) tensor of sink logits, got {type(sinks).__name__} "
            f"{getattr(sinks, 'dtype', '')}"
        )
    if sinks.shape != q.shape[1:2] or sinks.device != q.device or not sinks.is_contiguous():
        raise ValueError(
            f"sinks: expected a contiguous ({q.shape[1]},) tensor (one per query head) on "
            f"{q.device}, got {tuple(sinks.shape)} on {sinks.device}"
        )


def check_scales(q, k_cache, v_cache, k_scale, v_scale) -> None:
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
