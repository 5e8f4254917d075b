"""Learned attention sinks (gpt-oss, OpenAI 2025: one logit per head in the softmax denominator,
no value; chapter 17) in the numpy reference, chapter 4's tiled (online-softmax) attention and
split-K merge, and the torch reference backend: all equal to the formula written out,
out = Σ_j exp(s_j - m) v_j / (exp(sink - m) + Σ_j exp(s_j - m)), and the sink added once per
merge, not once per split (the classic bug, shown to give another answer).

Tolerances: numpy float64 paths that sum the same terms in another order agree to 1e-12; the
torch backend in float64 to 1e-12 as well (float32 inputs: 1e-5, its softmax's round-off).
"""

import math

import numpy as np
import pytest
import torch

from kvlib.ops.attention import reference_attention
from kvlib.ref import online_softmax as O
from kvlib.ref.attention import attention, attention_weights, causal_mask
from kvlib.testing import assert_close

F64 = {"rtol": 1e-12, "atol": 1e-12}


def qkv(t, s, d=8, d_v=5, seed=0, heads=None):
    rng = np.random.default_rng(seed)
    lead = () if heads is None else (heads,)
    return (
        rng.normal(size=(*lead, t, d)) * 2,
        rng.normal(size=(*lead, s, d)),
        rng.normal(size=(*lead, s, d_v)),
    )


def written_out(q, k, v, sink, mask=None):
    """The formula, one head (T, D): scores, their max m (sink included), the sum."""
    scores = q @ k.T / math.sqrt(q.shape[1])  # (T, S)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    m = np.maximum(scores.max(axis=1), sink)[:, None]  # (T, 1)
    p = np.exp(scores - m)
    return (p @ v) / (np.exp(sink - m) + p.sum(axis=1, keepdims=True))


@pytest.mark.parametrize("sink", [-3.0, 0.0, 2.5, 40.0])
def test_the_reference_with_a_sink_is_the_formula(sink):
    q, k, v = qkv(4, 11)
    assert_close(attention(q, k, v, sinks=sink), written_out(q, k, v, sink), name="sink", **F64)
    weights = attention_weights(q, k, sinks=sink)
    assert np.all(weights.sum(axis=1) < 1), "the sink takes a share of every row"
    mask = causal_mask(4, 11)
    assert_close(
        attention(q, k, v, mask, sinks=sink), written_out(q, k, v, sink, mask), name="masked"
    )


def test_per_head_sinks_and_no_sink_unchanged():
    q, k, v = qkv(3, 9, heads=3, seed=1)
    sinks = np.array([-1.0, 0.5, 3.0])
    out = attention(q, k, v, sinks=sinks)  # (H, T, D_v)
    for h in range(3):
        assert_close(out[h], written_out(q[h], k[h], v[h], sinks[h]), name=f"head {h}", **F64)
    assert np.array_equal(attention(q, k, v), attention(q, k, v, sinks=None))
    assert_close(attention(q, k, v, sinks=np.full(3, -800.0)), attention(q, k, v), **F64)
    huge = attention(q, k, v, sinks=np.full(3, 800.0))
    assert np.abs(huge).max() < 1e-300, "a dominant sink leaves (almost) nothing"


@pytest.mark.parametrize("sink", [None, -2.0, 1.5, 30.0])
@pytest.mark.parametrize("tile_size, query_tile", [(1, 1), (3, 2), (4, 7), (64, None)])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_online_softmax_equals_the_reference(sink, tile_size, query_tile, causal):
    q, k, v = qkv(7, 13, seed=2)
    mask = causal_mask(7, 13) if causal else None
    expected = attention(q, k, v, mask, sinks=sink)
    tiled = O.tiled_attention(
        q, k, v, tile_size=tile_size, query_tile_size=query_tile, causal=causal, sink=sink
    )
    assert_close(tiled, expected, name="tiled with a sink", **F64)


@pytest.mark.parametrize("sink", [None, -2.0, 0.0, 1.5, 30.0])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 19])
def test_split_k_adds_the_sink_once_and_equals_the_reference(sink, num_splits):
    q, k, v = qkv(2, 17, seed=3)
    expected = attention(q, k, v, sinks=sink)
    split = O.split_k_attention(q, k, v, num_splits=num_splits, sink=sink)  # 19 > S: empty splits
    assert_close(split, expected, name=f"{num_splits} splits", **F64)
    bounds = np.linspace(0, 17, num_splits + 1).round().astype(int)
    partials = [O.partial_attention(q, k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    out, lse = O.merge_partials([o for o, _ in partials], [x for _, x in partials], sink=sink)
    scores = q @ k.T / math.sqrt(8)
    with_sink = scores if sink is None else np.concatenate([scores, np.full((2, 1), sink)], 1)
    assert_close(lse, np.log(np.exp(with_sink).sum(axis=1)), name="lse includes the sink", **F64)
    assert_close(out, expected, name="merged", **F64)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_the_sink_added_once_per_split_is_wrong(num_splits):
    """The classic bug: each split folds the sink into its own partial, then the partials are
    merged; the denominator counts exp(sink) num_splits times."""
    q, k, v = qkv(2, 17, seed=4)
    sink = 1.0
    bounds = np.linspace(0, 17, num_splits + 1).round().astype(int)
    per_split = [  # each split's partial merged with the sink: the bug
        O.merge_partials([o], [x], sink=sink)
        for o, x in (
            O.partial_attention(q, k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])
        )
    ]
    wrong, _ = O.merge_partials([o for o, _ in per_split], [x for _, x in per_split])
    right = attention(q, k, v, sinks=sink)
    assert np.abs(wrong - right).max() > 1e-3, "a sink per split must change the answer"
    once_each = O.split_k_attention(q, k, v, num_splits=num_splits, sink=sink)
    assert_close(once_each, right, name="sink once", **F64)
    # the bug's answer is exactly the reference with the sink's exp counted num_splits times
    assert_close(wrong, attention(q, k, v, sinks=sink + math.log(num_splits)), **F64)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_the_torch_backend_equals_the_numpy_reference_per_head(dtype, tolerance):
    """GQA (4 query heads over 2 KV heads), a causal chunk, one sink per query head."""
    q, k, v = qkv(5, 9, heads=4, seed=5)
    sinks = np.array([-1.0, 0.0, 2.0, 6.0])
    k, v = k[::2], v[::2]  # (H_kv = 2, S, D): query head h reads KV head h // 2
    mask = causal_mask(5, 9)
    t = {name: torch.tensor(x, dtype=dtype) for name, x in dict(q=q, k=k, v=v, s=sinks).items()}
    out = reference_attention(
        t["q"][None], (t["k"][None], t["v"][None]), torch.tensor(mask)[None], sinks=t["s"]
    )[0]  # (H, T, D_v)
    expected = attention(q, np.repeat(k, 2, axis=0), np.repeat(v, 2, axis=0), mask, sinks=sinks)
    assert_close(out, expected, name=f"torch sinks {dtype}", rtol=tolerance, atol=tolerance)
    plain = reference_attention(
        t["q"][None], (t["k"][None], t["v"][None]), torch.tensor(mask)[None]
    )
    assert torch.equal(
        plain,
        reference_attention(
            t["q"][None], (t["k"][None], t["v"][None]), torch.tensor(mask)[None], sinks=None
        ),
    )


def test_sink_arguments_are_validated():
    q, k, v = qkv(2, 5, heads=2)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(2,\)"):
        attention(q, k, v, sinks=np.zeros(3))
    with pytest.raises(TypeError, match="sinks: expected a numpy array"):
        attention(q, k, v, sinks=[0.0, 0.0])
    q1, k1, v1 = qkv(2, 5)
    with pytest.raises(ValueError, match="sink: expected a finite logit"):
        O.tiled_attention(q1, k1, v1, tile_size=2, sink=math.inf)
    with pytest.raises(TypeError, match="sink: expected a finite float logit or None, got str"):
        O.split_k_attention(q1, k1, v1, num_splits=2, sink="1")
    tq = torch.zeros(1, 4, 2, 8)
    kv = (torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    mask = torch.ones(1, 2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"sinks: expected shape \(4,\)"):
        reference_attention(tq, kv, mask, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="sinks: expected a floating"):
        reference_attention(tq, kv, mask, sinks=torch.zeros(4, dtype=torch.int64))
