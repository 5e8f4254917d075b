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
- learned sinks (chapter 17; gpt-oss, OpenAI 2025): with `sinks`, one logit per query head joins
  each head's softmax denominator with value 0, once, where the splits are merged (the reduce;
  the split kernel itself when one split is the whole sequence), never once per split, which
  would count it `num_splits` times (`kvlib.ref.online_softmax.merge_partials`). Without them
  the sink code is compiled out (`HAS_SINKS` is a constexpr): the same instructions as before,
  and one unused pointer argument more.

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

import torch

from kvlib.ops.decode_checks import check_inputs, check_sinks, check_values
from kvlib.ops.decode_plan import (
    LOG2_E,
    LaunchPlan,
    default_num_splits,
    launch_plan,
    next_power_of_2,
)
from kvlib.ops.direct_launch import KernelLaunch
from kvlib.ops.triton_import import (  # noqa: F401 (re-exported)
    TritonUnavailableError,
    import_triton_module,
    triton_available,
)

_KERNEL_NAMES = ("_decode_split_kernel", "_reduce_splits_kernel")  # in kvlib.ops.triton_decode


def _triton_kernels():
    """The module holding the decode @triton.jit kernels, imported on first launch."""
    return import_triton_module(
        "kvlib.ops.triton_decode", "paged_decode_attention", "kvlib.kernels"
    )


def __getattr__(name: str):
    """`kvlib.kernels._decode_split_kernel` and `_reduce_splits_kernel`, loaded (with Triton) on
    first use, so that importing this module never needs Triton."""
    if name in _KERNEL_NAMES:
        return getattr(_triton_kernels(), name)
    raise AttributeError(f"module 'kvlib.kernels' has no attribute {name!r}")


_KERNELS = None  # kvlib.ops.triton_decode, once imported


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
    sinks=None,
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
            max(block_size, 64) on a GPU (`GPU_LAUNCH`), max(block_size, 64) in the interpreter.
        num_warps, num_stages: Triton launch options of the split kernel; default `GPU_LAUNCH`'s
            on a GPU (the interpreter ignores them).
        k_scale, v_scale: (num_blocks, block_size, H_kv) float16/float32, contiguous: a quantized
            cache's per-token symmetric scales (`x = scale · code`), both or neither.
        out: a (B, H, D) tensor of q's dtype to write the result into (else one is allocated).
        workspace: a `DecodeWorkspace` of at least B sequences and `num_splits` splits (else its
            two buffers are allocated per call).
        sinks: (H,) float32, contiguous, on q's device: learned sink logits (gpt-oss), one per
            query head in the units of the scaled scores (`score · scale`); each joins its head's
            softmax denominator once, with value 0 (`kvlib.ops.attention.reference_attention`'s
            `sinks`). None (the default): no sinks, the sink code compiled out.
    Returns:
        (B, H, D) in q's dtype (`out` if given); accumulation in fp32.
    Raises:
        TypeError, ValueError: inputs that disagree in shape, dtype or device, H not a multiple
        of H_kv, lengths beyond the block table, block ids outside the cache (with `validate`),
        inputs off the GPU where the kernel is compiled (`kvlib.ops.devices.kernel_device`).
        TritonUnavailableError: Triton cannot be imported here (use `paged_decode_attention_ref`).

    The hot path, `validate=False` with `num_splits` (or `max_seq_len`) given, makes no host
    sync: shapes and strides are checked once per distinct metadata and the launch plan cached
    (`_PLANS`), the SM count is cached, and with `out` and `workspace` nothing is allocated.
    """
    plan = launch_plan(
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
        sinks,
    )
    longest = (
        check_values(block_tables, seq_lens, plan.num_blocks, plan.block_size) if validate else None
    )
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if longest is None else longest  # a host sync
        num_splits = default_num_splits(plan.batch, plan.num_kv_heads, max_seq_len, q.device)
    elif not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1, got {num_splits!r}")
    if out is None:
        out = torch.empty_like(q)
    kernels = _KERNELS or _load_kernels()
    split, reduce = plan.launches.get((kernels._decode_split_kernel, num_splits)) or _launches(
        plan, kernels, num_splits, out
    )
    if reduce is None:  # one split: the split kernel writes `out`; no partials to merge
        partial_out = partial_lse = out  # (pointers the kernel does not use)
    elif workspace is None:
        shape = (plan.batch, plan.num_heads, num_splits)
        partial_out = torch.empty(*shape, plan.head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    else:
        if num_splits > plan.workspace_splits:
            raise ValueError(
                f"workspace: holds {plan.workspace_splits} splits, num_splits is {num_splits}"
            )
        partial_out, partial_lse = workspace
    qk_scale = plan.qk_scale if scale is None else float(scale) * LOG2_E
    split(
        q,
        k_cache,
        v_cache,
        k_scale if plan.quantized else k_cache,  # unused pointers when not quantized
        v_scale if plan.quantized else v_cache,
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        sinks if plan.has_sinks else q,  # an unused pointer without sinks
        qk_scale,
    )
    if reduce is not None:
        reduce(partial_out, partial_lse, out, sinks if plan.has_sinks else out)
    return out


def _launches(plan: LaunchPlan, kernels, num_splits: int, out: torch.Tensor) -> tuple:
    """The plan's launches at `num_splits` splits (`kvlib.ops.direct_launch.KernelLaunch`): the
    split kernel, and the reduce, None for one split (the split kernel then writes the output
    itself). Their trailing arguments (strides, the split count) are fixed by the plan: `out` is
    the caller's (in the plan's metadata) or `empty_like(q)`, whose strides follow q's. Kept in
    the plan, keyed by the kernel object (a benchmark may stand one in)."""
    single = num_splits == 1
    if single:
        partial_strides = (0, 0, 0, 0, 0)  # no partials
    elif plan.workspace_splits:
        partial_strides = plan.workspace_strides
    else:  # contiguous (B, H, num_splits, D) and (B, H, num_splits), allocated per call
        head_stride = num_splits * plan.head_dim
        partial_strides = (
            plan.num_heads * head_stride,
            head_stride,
            plan.head_dim,
            plan.num_heads * num_splits,
            num_splits,
        )
    out_strides = out.stride()[:2]
    split = KernelLaunch(
        kernels._decode_split_kernel,
        (plan.batch, plan.num_kv_heads, num_splits),
        (*plan.fixed_strides, *partial_strides, *out_strides, num_splits),
        {**plan.split_options, "SINGLE_SPLIT": single},
        plan.device_index,
        num_tensors=11,
    )
    reduce = None
    if not single:
        reduce = KernelLaunch(
            kernels._reduce_splits_kernel,
            (plan.batch, plan.num_heads),
            (*partial_strides, *out_strides, num_splits),
            {**plan.reduce_options, "BLOCK_S": next_power_of_2(num_splits)},
            plan.device_index,
            num_tensors=4,
        )
    plan.launches[kernels._decode_split_kernel, num_splits] = split, reduce
    return split, reduce


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
    sinks=None,
    **launch_options,
):
    """Reference for `paged_decode_attention`, same arguments: gather each sequence's K/V through
    its block table (dequantized, `scale · code`, when scales are given), repeat KV heads for their
    query groups, and attend in fp32 with plain torch, each head's sink logit (if any) one more
    column of its scores, dropped after the softmax (the kernel's launch options, `num_splits`,
    `block_n`, `num_warps`, `num_stages`, are accepted and change nothing here).

    Returns (B, H, D) in q's dtype.
    """
    batch, num_heads, num_kv_heads, head_dim = check_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale
    )
    check_sinks(q, sinks)
    if validate:
        check_values(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
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
        if sinks is not None:  # (H, S + 1): the sink column, dropped after the softmax
            weights = torch.cat([scores, sinks[:, None]], dim=1).softmax(dim=-1)[:, :-1]
        else:
            weights = scores.softmax(dim=-1)
        out[b] = torch.einsum("hs,shd->hd", weights, v).to(q.dtype)  # (H, D)
    return out
