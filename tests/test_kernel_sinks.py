"""Learned sinks (gpt-oss; chapter 17) in chapter 11's split-K paged decode kernel, under Triton's
interpreter on the CPU (compiled on a GPU where CUDA is present: `KERNEL_DEVICE`):

- the kernel with `sinks` equals `kvlib.ops.attention.reference_attention(..., sinks=)` over each
  sequence's K/V gathered densely, for 1, 2, 3 and 5 splits (several of them non-empty: tiles of
  16 tokens), MHA, GQA and MQA, float32 and float16, and its reference
  (`paged_decode_attention_ref`) does too;
- the sink joins once, in the merge: the kernel's own partials (read from a caller's workspace)
  merged with the sink once give the kernel's output, while adding it to each of k splits gives
  the answer of a sink k times as heavy (logit + ln k), not the reference's;
- sinks=None plans and launches as before (`HAS_SINKS` False, the same arguments), a hot call
  with sinks reads metadata only (no allocation, no host sync), and the argument is validated by
  name.

Tolerances: float32 as tests/test_kernels.py (1e-5; exp2 and the merge reorder the sums), float16
inputs 2e-3.
"""

import math
import types

import pytest
import torch

import kvlib.kernels as K  # first: sets TRITON_INTERPRET on a machine without CUDA
import kvlib.ops.decode_plan as P
from kvlib.ops.attention import reference_attention
from kvlib.testing import assert_close
from tests.test_kernels import (
    CPU_LENGTHS,
    KERNEL_DEVICE,
    TOLERANCES,
    CountTorchCalls,
    FakeLaunchKernel,
    make_paged_cache,
)


def sink_logits(num_heads, seed=0):
    """(H,) float32 logits of every size: random, one large (it takes most of its head's
    weight) and one very negative (it takes none)."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 8.0, -30.0
    return sinks.to(KERNEL_DEVICE)


def dense_oracle(q, k_cache, v_cache, block_tables, seq_lens, sinks):
    """`reference_attention` with `sinks` over each sequence's K/V gathered in logical order:
    (B, H, D) in float64."""
    block_size, outputs = k_cache.shape[1], []
    for b in range(q.shape[0]):
        length = int(seq_lens[b])
        blocks = block_tables[b, : math.ceil(length / block_size)].long()
        k, v = (
            pool[blocks].flatten(0, 1)[:length].transpose(0, 1)[None].double()  # (1, H_kv, S, D)
            for pool in (k_cache, v_cache)
        )
        mask = torch.ones(1, 1, length, dtype=torch.bool, device=q.device)
        out = reference_attention(
            q[b, :, None][None].double(),
            (k, v),
            mask,
            sinks=None if sinks is None else sinks.double(),
        )  # (1, H, 1, D)
        outputs.append(out[0, :, 0])
    return torch.stack(outputs)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])  # G = 1, 4, 8
def test_kernel_with_sinks_equals_the_reference_attention(num_splits, num_heads, num_kv_heads):
    inputs = make_paged_cache(CPU_LENGTHS, num_heads, num_kv_heads, 16, 16, torch.float32)
    inputs = [t.to(KERNEL_DEVICE) for t in inputs]
    sinks = sink_logits(num_heads, seed=num_splits)
    out = K.paged_decode_attention(*inputs, sinks=sinks, num_splits=num_splits, block_n=16)
    oracle = dense_oracle(*inputs, sinks)
    name = f"kernel with sinks, {num_splits} splits, H={num_heads}, H_kv={num_kv_heads}"
    assert_close(out, oracle, name=name, rtol=1e-5, atol=1e-5)
    assert_close(
        K.paged_decode_attention_ref(*inputs, sinks=sinks), oracle, name="ref", rtol=1e-5, atol=1e-5
    )
    without = K.paged_decode_attention(*inputs, num_splits=num_splits, block_n=16)
    assert (out - without).abs().max() > 0.1, "the sinks changed nothing: the test is vacuous"
    assert_close(without, dense_oracle(*inputs, None), name="no sinks", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_float16_inputs_with_sinks(num_splits):
    inputs = make_paged_cache([7, 45, 100], 8, 2, 16, 16, torch.float16)
    inputs = [t.to(KERNEL_DEVICE) for t in inputs]
    sinks = sink_logits(8, seed=3)
    out = K.paged_decode_attention(*inputs, sinks=sinks, num_splits=num_splits, block_n=16)
    assert out.dtype == torch.float16
    rtol, atol = TOLERANCES[torch.float16]
    assert_close(out, dense_oracle(*inputs, sinks), name="float16", rtol=rtol, atol=atol)


def merge(partial_out, partial_lse, sinks_log2=None):
    """The reduce in torch, log2 domain: partials (B, H, n, D) and their lse (B, H, n), the sink
    (H,) added once as one more partial of output 0. Returns (B, H, D) float64."""
    lse = partial_lse.double()
    top = lse.amax(dim=-1)  # (B, H)
    if sinks_log2 is not None:
        top = torch.maximum(top, sinks_log2)
    weights = torch.exp2(lse - top[..., None])  # (B, H, n)
    denominator = weights.sum(dim=-1)
    if sinks_log2 is not None:
        denominator = denominator + torch.exp2(sinks_log2 - top)
    return (weights[..., None] * partial_out.double()).sum(dim=2) / denominator[..., None]


@pytest.mark.parametrize("num_splits", [3, 5])
def test_the_sink_joins_once_in_the_merge_and_once_per_split_is_wrong(num_splits):
    lengths = [100, 45, 17]  # tiles of 16: 100 tokens fill 3 splits; 17 leave some splits empty
    inputs = make_paged_cache(lengths, 8, 2, 16, 16, torch.float32)
    inputs = [t.to(KERNEL_DEVICE) for t in inputs]
    sinks = sink_logits(8, seed=7)
    sinks[0] = 1.0  # a sink of moderate weight everywhere, so that counting it k times shows
    workspace = P.DecodeWorkspace.allocate(3, 8, 16, max_splits=num_splits, device=KERNEL_DEVICE)
    out = K.paged_decode_attention(
        *inputs, sinks=sinks, num_splits=num_splits, block_n=16, workspace=workspace
    )
    partial_out = workspace.partial_out[:, :, :num_splits]  # (B, H, n, D): no sink in them
    partial_lse = workspace.partial_lse[:, :, :num_splits]  # (B, H, n), log2 domain
    sinks_log2 = sinks.double() * math.log2(math.e)
    once = merge(partial_out, partial_lse, sinks_log2)
    assert_close(once, out, name="the partials merged with the sink once", rtol=1e-5, atol=1e-5)
    # the bug: every split's online softmax starts from the sink (m = sink, l = 1, acc = 0), so
    # each partial, even an empty split's, carries it: lse_i' = log2(2^lse_i + 2^sink)
    per_split_lse = torch.logaddexp2(partial_lse.double(), sinks_log2[:, None])
    per_split_out = (
        partial_out.double() * torch.exp2(partial_lse.double() - per_split_lse)[..., None]
    )
    buggy = merge(per_split_out, per_split_lse)
    heavier = dense_oracle(*inputs, sinks + math.log(num_splits))  # a sink counted n times
    assert_close(
        buggy, heavier, name="per-split sinks = one sink of logit + ln n", rtol=1e-5, atol=1e-5
    )
    difference = (buggy - dense_oracle(*inputs, sinks)).abs().max()
    assert difference > 1e-2, f"the per-split sink should be visibly wrong, off by {difference}"


def test_without_sinks_the_plan_and_the_launch_are_as_before(monkeypatch):
    """sinks=None: `HAS_SINKS` False in both kernels' constexprs, and a plan of its own (sinks
    given make another); the sinks pointer slot gets an unused tensor, as the scales do."""
    launches = []

    class Recording:
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append((args, options))

    kernels = types.SimpleNamespace(
        _decode_split_kernel=Recording(), _reduce_splits_kernel=Recording()
    )
    monkeypatch.setattr(K, "_KERNELS", kernels)
    inputs = make_paged_cache([5, 40], 8, 2, 16, 16, torch.float32)
    K.paged_decode_attention(*inputs, num_splits=2, validate=False)
    (split_args, split_options), (reduce_args, reduce_options) = launches[-2:]
    assert split_options["HAS_SINKS"] is False and reduce_options["HAS_SINKS"] is False
    assert split_args[10] is inputs[0] and reduce_args[3] is reduce_args[2]  # unused pointers
    sinks = torch.zeros(8)
    K.paged_decode_attention(*inputs, num_splits=2, validate=False, sinks=sinks)
    (split_args, split_options), (reduce_args, reduce_options) = launches[-2:]
    assert split_options["HAS_SINKS"] is True and reduce_options["HAS_SINKS"] is True
    assert split_args[10] is sinks and reduce_args[3] is sinks


def test_sinks_are_validated_by_name():
    inputs = make_paged_cache([5, 40], 8, 2, 16, 16, torch.float32)
    for function in (K.paged_decode_attention, K.paged_decode_attention_ref):
        with pytest.raises(TypeError, match="sinks: expected a float32 \\(H,\\) tensor"):
            function(*inputs, sinks=torch.zeros(8, dtype=torch.float64))
        with pytest.raises(TypeError, match="sinks: expected a float32 \\(H,\\) tensor"):
            function(*inputs, sinks=[0.0] * 8)
        with pytest.raises(ValueError, match="sinks: expected a contiguous \\(8,\\) tensor"):
            function(*inputs, sinks=torch.zeros(2))
        with pytest.raises(ValueError, match="sinks: expected a contiguous \\(8,\\) tensor"):
            function(*inputs, sinks=torch.zeros(16)[::2])


def test_the_hot_call_with_sinks_reads_metadata_only(monkeypatch):
    """With sinks, caller buffers and validate=False, a call after the first reads metadata only:
    no allocation, no host sync (the sinks are checked once per plan, as the other inputs)."""
    monkeypatch.setattr(
        K,
        "_KERNELS",
        types.SimpleNamespace(
            _decode_split_kernel=FakeLaunchKernel(), _reduce_splits_kernel=FakeLaunchKernel()
        ),
    )
    inputs = make_paged_cache([5, 40, 17], 8, 2, 16, 16, torch.float32)
    options = dict(
        num_splits=3,
        validate=False,
        out=torch.empty_like(inputs[0]),
        workspace=P.DecodeWorkspace.allocate(4, 8, 16, max_splits=8),
        sinks=sink_logits(8).cpu(),
    )
    K.paged_decode_attention(*inputs, **options)
    with CountTorchCalls() as counter:
        K.paged_decode_attention(*inputs, **options)
    assert set(counter.calls) <= {"__get__", "stride"}, counter.calls
