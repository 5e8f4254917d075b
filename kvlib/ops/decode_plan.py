"""The launch plan of the paged decode-attention kernel (`kvlib.kernels`): what a launch derives
from its inputs' metadata alone (grid sizes, strides, constexprs, launch options), checked and
computed once per distinct metadata and cached (`launch_plan`, `_PLANS`), so the hot path of a
decode loop pays no checks; the split count that fills a GPU (`default_num_splits`); the launch
options frozen from the H100 sweep (`GPU_LAUNCH`); and the caller-owned scratch buffers
(`DecodeWorkspace`).

The cache key is read on every call, so it is kept short: the tensors that change from call to
call (the queries, block tables, lengths, scales, output) by their metadata (shape, strides,
dtype, device); the long-lived ones, the K/V pools and the workspace, by identity, held weakly
(a plan made for one pool is never used for another, nor kept alive for it). What this does not
notice: a pool or workspace whose metadata is changed in place (`resize_`, `set_`) between
calls."""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch

from kvlib._validate import check_positive_int
from kvlib.ops.decode_checks import check_inputs, check_sinks
from kvlib.ops.interpreter import INTERPRETED
from kvlib.ops.launch import choose_num_splits

LOG2_E = 1.4426950408889634


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length()


# Launch options frozen from the H100 sweep in results/decode_tuning.csv (`python -m
# kvlib.experiments.decode_tuning`, 8 split counts x 3 BLOCK_N x 2 num_warps x 2 num_stages on 12
# shapes): at the split count `choose_num_splits` picks, this one setting was within 3% of the
# fastest configuration anywhere in the sweep on all twelve. Frozen, not autotuned at run time,
# so every run (and the CPU interpreter) is repeatable.
GPU_LAUNCH = {"block_n": 64, "num_warps": 4, "num_stages": 3}


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
        cls, max_batch: int, num_heads: int, head_dim: int, *, max_splits: int = 128, device="cpu"
    ) -> DecodeWorkspace:
        """Uninitialised buffers for batches of up to `max_batch` sequences of `num_heads` query
        heads of width `head_dim`, and up to `max_splits` splits (`choose_num_splits`'s cap is
        128)."""
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


class LaunchPlan(NamedTuple):
    """What a launch derives from its inputs' metadata alone, checked and computed once per
    distinct metadata (`_PLANS`)."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    quantized: bool
    has_sinks: bool  # learned sinks (`HAS_SINKS`): the sinks pointer is read
    qk_scale: float  # the default scale D**-0.5, times log2(e)
    fixed_strides: tuple  # q, cache, scale and block-table strides, in the kernel's order
    workspace_splits: int  # splits the caller's workspace holds (0: none given)
    workspace_strides: tuple  # its partial_out and partial_lse strides (() without one)
    split_options: dict  # constexprs and launch options of the split kernel
    reduce_options: dict  # constexprs of the reduce kernel (BLOCK_S comes per call)
    device_index: int | None  # the CUDA device's index (None: not a CUDA device)
    # split count -> its kernels' `kvlib.ops.direct_launch.KernelLaunch`es (split, reduce or None)
    launches: dict
    owners: tuple  # weak references to the pools and workspace tensors the plan was made for


_PLANS: dict = {}  # key -> LaunchPlan; bounded by _MAX_PLANS


_MAX_PLANS = 4096  # one plan per layer's pools and batch shape: a model's layers times its shapes


def _owned(plan: LaunchPlan, k_cache, v_cache, workspace) -> bool:
    """Whether `plan` was made for these very pools and workspace (their ids may have been reused
    by new tensors since)."""
    refs = plan.owners
    return (
        refs[0]() is k_cache
        and refs[1]() is v_cache
        and (workspace is None or (refs[2]() is workspace[0] and refs[3]() is workspace[1]))
    )


def launch_plan(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    k_scale,
    v_scale,
    out,
    workspace,
    launch,
    sinks=None,
) -> LaunchPlan:
    """The launch plan of these inputs: from the cache when the same pools and workspace, the same
    metadata (shapes, strides, dtypes, devices) of the other tensors and the same launch options
    were seen before, else checked (`check_inputs`, `check_sinks`) and computed (see the module
    docstring)."""
    try:  # written out: this runs every call
        key = (
            id(k_cache), id(v_cache),
            q.shape, q.stride(), q.dtype, q.device,
            block_tables.shape, block_tables.stride(), block_tables.dtype, block_tables.device,
            seq_lens.shape, seq_lens.stride(), seq_lens.dtype, seq_lens.device,
            None if k_scale is None and v_scale is None else (
                k_scale.shape, k_scale.stride(), k_scale.dtype, k_scale.device,
                v_scale.shape, v_scale.stride(), v_scale.dtype, v_scale.device),
            None if out is None else (out.shape, out.stride(), out.dtype, out.device),
            None if workspace is None else (type(workspace), id(workspace[0]), id(workspace[1])),
            launch,
            None if sinks is None else (sinks.shape, sinks.stride(), sinks.dtype, sinks.device),
        )  # fmt: skip
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: check_inputs says which
        key = plan = None
    if plan is not None and _owned(plan, k_cache, v_cache, workspace):
        return plan
    plan = _make_plan(
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, out, workspace, launch, sinks
    )
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _make_plan(
    q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, out, workspace, launch, sinks
) -> LaunchPlan:
    batch, num_heads, num_kv_heads, head_dim = check_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale
    )
    check_sinks(q, sinks)
    if not INTERPRETED and q.device.type != "cuda":
        raise ValueError(
            f"q, k_cache, v_cache, block_tables, seq_lens: the kernel is compiled for CUDA here "
            f"(TRITON_INTERPRET is not 1), so they must be on a CUDA device, got {q.device}. "
            "Move them with .to('cuda') (kvlib.ops.devices.kernel_device() names the device), "
            "or use kvlib.kernels.paged_decode_attention_ref on the CPU"
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
    block_d = max(16, next_power_of_2(head_dim))
    compute_fp32 = INTERPRETED or q.dtype == torch.float32
    split_options = dict(
        GROUP_SIZE=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, next_power_of_2(num_heads // num_kv_heads)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        COMPUTE_FP32=compute_fp32,
        # fp32 dots in IEEE fp32: a GPU's default TF32 keeps 10 mantissa bits and misses rtol 1e-5.
        # (For bf16/fp16 inputs "tf32" is the default and changes nothing.)
        DOT_PRECISION="ieee" if compute_fp32 else "tf32",
        QUANTIZED=quantized,
        HAS_SINKS=sinks is not None,
    )
    if num_warps is not None:
        split_options["num_warps"] = num_warps
    if num_stages is not None:
        split_options["num_stages"] = num_stages
    return LaunchPlan(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        quantized=quantized,
        has_sinks=sinks is not None,
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
        reduce_options=dict(HEAD_DIM=head_dim, BLOCK_D=block_d, HAS_SINKS=sinks is not None),
        device_index=q.device.index if q.device.type == "cuda" else None,
        launches={},
        owners=tuple(
            weakref.ref(t) for t in (k_cache, v_cache, *(() if workspace is None else workspace))
        ),
    )
