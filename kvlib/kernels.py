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

import functools
import math
import os
from typing import NamedTuple

import torch

from kvlib._validate import check_positive_int
from kvlib.ops.launch import choose_num_splits

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
    return batch, num_heads, num_kv_heads, head_dim


def _check_values(block_tables, seq_lens, num_blocks: int, block_size: int) -> int:
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


@functools.cache
def _num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device, queried once per device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Split count that fills the device's SMs (`ops.launch.choose_num_splits`); 1 on CPU. The SM
    count is queried once per device and cached."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    index = torch.cuda.current_device() if device.index is None else device.index
    return choose_num_splits(batch_size, num_kv_heads, max_seq_len, num_sms=_num_sms(index))


class DecodeWorkspace(NamedTuple):
    """Scratch buffers of the split kernel, which a caller may allocate once and pass to every
    call (`paged_decode_attention(..., workspace=ws)`): one partial output and one log2-sum-exp2
    per (sequence, query head, split), in fp32. Any batch up to `max_batch` and split count up to
    `max_splits` fits (the kernel addresses them by strides; nothing is sliced or copied)."""

    partial_out: torch.Tensor  # (max_batch, H, max_splits, D) float32
    partial_lse: torch.Tensor  # (max_batch, H, max_splits) float32

    @classmethod
    def allocate(
        cls, max_batch: int, num_heads: int, head_dim: int, *, max_splits: int = 64, device="cpu"
    ) -> DecodeWorkspace:
        """Uninitialised buffers for batches of up to `max_batch` sequences of `num_heads` query
        heads of width `head_dim`, and up to `max_splits` splits (`choose_num_splits`'s cap is
        64)."""
        for name, value in (
            ("max_batch", max_batch),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("max_splits", max_splits),
        ):
            check_positive_int(name, value)
        return cls(
            torch.empty(
                max_batch, num_heads, max_splits, head_dim, dtype=torch.float32, device=device
            ),
            torch.empty(max_batch, num_heads, max_splits, dtype=torch.float32, device=device),
        )


class _Plan(NamedTuple):
    """What a launch derives from its inputs' metadata alone, checked and computed once per
    distinct metadata (`_PLANS`)."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    quantized: bool
    qk_scale: float  # the default scale D**-0.5, times log2(e)
    fixed_strides: tuple  # q, cache, scale and block-table strides, in the kernel's order
    workspace_splits: int  # splits the caller's workspace holds (0: none given)
    workspace_strides: tuple  # its partial_out and partial_lse strides (() without one)
    split_options: dict  # constexprs and launch options of the split kernel
    reduce_options: dict  # constexprs of the reduce kernel (BLOCK_S comes per call)


_PLANS: dict = {}  # metadata key -> _Plan; bounded by _MAX_PLANS
_MAX_PLANS = 256
_KERNELS = None  # kvlib.ops.triton_decode, once imported


def _metadata(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def _plan(
    q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, out, workspace, launch
) -> _Plan:
    """The launch plan of these inputs: from the cache when the same metadata (shapes, strides,
    dtypes, devices) and launch options were seen before, else checked (`_check_inputs`) and
    computed."""
    try:
        key = (
            _metadata(q),
            _metadata(k_cache),
            _metadata(v_cache),
            _metadata(block_tables),
            _metadata(seq_lens),
            _metadata(k_scale),
            _metadata(v_scale),
            _metadata(out),
            None if workspace is None else (type(workspace), *map(_metadata, workspace)),
            launch,
        )
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: _check_inputs says which
        key = plan = None
    if plan is not None:
        return plan
    plan = _make_plan(
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, out, workspace, launch
    )
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _make_plan(
    q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, out, workspace, launch
) -> _Plan:
    batch, num_heads, num_kv_heads, head_dim = _check_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale
    )
    num_blocks, block_size = k_cache.shape[:2]
    block_n, num_warps, num_stages = launch
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
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        if (out.shape, out.dtype, out.device) != (q.shape, q.dtype, q.device) or (
            out.stride(-1) != 1
        ):
            raise ValueError(
                f"out: expected a {tuple(q.shape)} {q.dtype} tensor on {q.device} with a "
                f"contiguous last dimension, got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
    workspace_splits, workspace_strides = 0, ()
    if workspace is not None:
        if not isinstance(workspace, DecodeWorkspace):
            raise TypeError(
                f"workspace: expected a DecodeWorkspace, got {type(workspace).__name__}"
            )
        partial_out, partial_lse = workspace
        if (
            partial_out.dim() != 4
            or partial_lse.shape != partial_out.shape[:3]
            or partial_out.shape[0] < batch
            or tuple(partial_out.shape[1:4:2]) != (num_heads, head_dim)
            or {partial_out.dtype, partial_lse.dtype} != {torch.float32}
            or {partial_out.device, partial_lse.device} != {q.device}
            or partial_out.stride(-1) != 1
            or partial_lse.stride(-1) != 1
        ):
            raise ValueError(
                f"workspace: expected float32 buffers on {q.device} for at least {batch} "
                f"sequences, {num_heads} heads and D = {head_dim} "
                f"(DecodeWorkspace.allocate), got {tuple(partial_out.shape)} and "
                f"{tuple(partial_lse.shape)}"
            )
        workspace_splits = partial_out.shape[2]
        workspace_strides = (*partial_out.stride()[:3], *partial_lse.stride()[:2])
    quantized = k_scale is not None
    # tl.dot's K dimension on a GPU is >= 16; masks cover the padding
    block_d = max(16, _next_power_of_2(head_dim))
    compute_fp32 = INTERPRETED or q.dtype == torch.float32
    split_options = dict(
        GROUP_SIZE=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, _next_power_of_2(num_heads // num_kv_heads)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        COMPUTE_FP32=compute_fp32,
        # fp32 dots in IEEE fp32: a GPU's default TF32 keeps 10 mantissa bits and misses rtol 1e-5.
        # (For bf16/fp16 inputs "tf32" is the default and changes nothing.)
        DOT_PRECISION="ieee" if compute_fp32 else "tf32",
        QUANTIZED=quantized,
    )
    if num_warps is not None:
        split_options["num_warps"] = num_warps
    if num_stages is not None:
        split_options["num_stages"] = num_stages
    return _Plan(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        quantized=quantized,
        qk_scale=head_dim**-0.5 * LOG2_E,
        fixed_strides=(
            q.stride(0),
            q.stride(1),
            *k_cache.stride()[:3],
            *(k_scale.stride()[:2] if quantized else (0, 0)),
            block_tables.stride(0),
        ),
        workspace_splits=workspace_splits,
        workspace_strides=workspace_strides,
        split_options=split_options,
        reduce_options=dict(HEAD_DIM=head_dim, BLOCK_D=block_d),
    )


def paged_decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale=None,
    num_splits=None,
    max_seq_len=None,
    validate=True,
    block_n=None,
    num_warps=None,
    num_stages=None,
    k_scale=None,
    v_scale=None,
    out=None,
    workspace=None,
):
    """Decode attention over a paged KV cache (one new query per sequence and head).

    Args:
        q: (B, H, D) float32 / float16 / bfloat16.
        k_cache, v_cache: (num_blocks, block_size, H_kv, D), q's dtype, the same strides; block_size
            a power of two. With scales: int8, float8_e4m3fn or float8_e5m2 codes.
        block_tables: (B, max_blocks_per_seq) int32; row b lists sequence b's physical blocks.
        seq_lens: (B,) int32, each in [1, max_blocks_per_seq * block_size].
        scale: softmax scale (a Python number), default D ** -0.5.
        num_splits: split-K factor; default fills the GPU's SMs (`default_num_splits`), from
            `max_seq_len`.
        max_seq_len: the longest length in `seq_lens`, when the caller knows it on the host (an
            engine does); it only chooses the default split count, the kernel reads the lengths
            from `seq_lens`. Without it (and without `num_splits`), the count needs
            `seq_lens.max()` on the host.
        validate: check lengths and block ids on the device first. That costs one blocking
            device-to-host copy per call: on a GPU the host waits for all queued work, so the
            next launches cannot be queued behind the running ones, and a CUDA graph cannot
            capture the call. It is the default because a wrong length or block id would
            otherwise read another sequence's memory silently.
        block_n: tokens per tile: a power of two >= 16 and a multiple of block_size; default
            max(block_size, 32) on a GPU (`GPU_LAUNCH`), max(block_size, 64) in the interpreter.
        num_warps, num_stages: Triton launch options of the split kernel; default `GPU_LAUNCH`'s
            on a GPU (the interpreter ignores them).
        k_scale, v_scale: (num_blocks, block_size, H_kv) float16/float32, contiguous: a quantized
            cache's per-token symmetric scales (`x = scale · code`), both or neither.
        out: a (B, H, D) tensor of q's dtype to write the result into (else one is allocated).
        workspace: a `DecodeWorkspace` of at least B sequences and `num_splits` splits (else its
            two buffers are allocated per call).
    Returns:
        (B, H, D) in q's dtype (`out` if given); accumulation in fp32.
    Raises:
        TypeError, ValueError: inputs that disagree in shape, dtype or device, H not a multiple
        of H_kv, lengths beyond the block table, block ids outside the cache (with `validate`).
        TritonUnavailableError: Triton cannot be imported here (use `paged_decode_attention_ref`).

    The hot path, `validate=False` with `num_splits` (or `max_seq_len`) given, makes no host
    sync: shapes and strides are checked once per distinct metadata and the launch plan cached
    (`_PLANS`), the SM count is cached, and with `out` and `workspace` nothing is allocated.
    """
    plan = _plan(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        k_scale,
        v_scale,
        out,
        workspace,
        (block_n, num_warps, num_stages),
    )
    longest = (
        _check_values(block_tables, seq_lens, plan.num_blocks, plan.block_size)
        if validate
        else None
    )
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if longest is None else longest  # a host sync
        num_splits = default_num_splits(plan.batch, plan.num_kv_heads, max_seq_len, q.device)
    elif not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1, got {num_splits!r}")
    if workspace is None:
        shape = (plan.batch, plan.num_heads, num_splits)
        partial_out = torch.empty(*shape, plan.head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        head_stride = num_splits * plan.head_dim
        partial_strides = (
            plan.num_heads * head_stride,
            head_stride,
            plan.head_dim,
            plan.num_heads * num_splits,
            num_splits,
        )
    else:
        if num_splits > plan.workspace_splits:
            raise ValueError(
                f"workspace: holds {plan.workspace_splits} splits, num_splits is {num_splits}"
            )
        partial_out, partial_lse = workspace
        partial_strides = plan.workspace_strides
    if out is None:
        out = torch.empty_like(q)
    kernels = _KERNELS or _load_kernels()
    qk_scale = plan.qk_scale if scale is None else float(scale) * LOG2_E
    kernels._decode_split_kernel[(plan.batch, plan.num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scale if plan.quantized else k_cache,  # unused pointers when not quantized
        v_scale if plan.quantized else v_cache,
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        qk_scale,
        *plan.fixed_strides,
        *partial_strides,
        num_splits,
        **plan.split_options,
    )
    kernels._reduce_splits_kernel[(plan.batch, plan.num_heads)](
        partial_out,
        partial_lse,
        out,
        *partial_strides,
        out.stride(0),
        out.stride(1),
        num_splits,
        BLOCK_S=_next_power_of_2(num_splits),
        **plan.reduce_options,
    )
    return out


def _load_kernels():
    """Import the kernels once (`_triton_kernels`) and keep them for the next calls."""
    global _KERNELS
    _KERNELS = _triton_kernels()
    return _KERNELS


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
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale
    )
    if validate:
        _check_values(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
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
