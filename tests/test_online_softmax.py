"""kvlib.ref.online_softmax against the reference attention, with property-based tests of the
merge."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.course.bench import loglog_slope, peak_memory_bytes
from kvlib.ref import online_softmax as O
from kvlib.ref.attention import attention, attention_weights, causal_mask, softmax
from kvlib.testing import assert_close


def qkv(t, s, d=8, d_v=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(t, d)), rng.normal(size=(s, d)), rng.normal(size=(s, d_v))


@pytest.mark.parametrize("block", [1, 3, 7, 100])
def test_online_softmax_update_gives_max_and_logsumexp(block):
    x = np.random.default_rng(block).normal(size=37) * 30
    m, l = -math.inf, 0.0
    for start in range(0, x.size, block):
        m, l = O.online_softmax_update(m, l, x[start : start + block])
    assert m == x.max()
    assert_close(np.exp(x - m) / l, softmax(x), name="softmax from the online state")
    assert_close(m + math.log(l), np.log(np.exp(x - x.max()).sum()) + x.max(), name="log-sum-exp")


def test_online_softmax_update_edge_cases():
    assert O.online_softmax_update(-math.inf, 0.0, np.array([])) == (-math.inf, 0.0)
    assert O.online_softmax_update(-math.inf, 0.0, np.array([-np.inf, -np.inf])) == (-math.inf, 0.0)
    m, l = O.online_softmax_update(-math.inf, 0.0, np.array([1000.0, 1000.0]))
    assert (m, l) == (1000.0, 2.0)
    with pytest.raises(ValueError, match="block: expected 1 dimensions"):
        O.online_softmax_update(0.0, 1.0, np.zeros((2, 2)))


@pytest.mark.parametrize("tile_size", [1, 2, 5, 16, 29, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_attention_equals_reference(tile_size, causal):
    q, k, v = qkv(13, 29, seed=tile_size)
    mask = causal_mask(13, 29) if causal else None
    expected = attention(q, k, v, mask)
    for query_tile in (None, 4, 13):
        got = O.tiled_attention(
            q, k, v, tile_size=tile_size, query_tile_size=query_tile, causal=causal
        )
        assert_close(
            got,
            expected,
            name=f"tiled attention (tile {tile_size}, query tile {query_tile}, causal={causal})",
            rtol=1e-12,
            atol=1e-13,
        )


def test_tiled_attention_survives_huge_scores_and_validates():
    q, k, v = qkv(4, 10)
    assert_close(
        O.tiled_attention(q * 300, k * 300, v, tile_size=3),
        attention(q * 300, k * 300, v),
        name="large scores",
        rtol=1e-9,
    )
    with pytest.raises(ValueError, match="tile_size: expected an int >= 1, got 0"):
        O.tiled_attention(q, k, v, tile_size=0)
    with pytest.raises(ValueError, match="causal attention needs T <= S"):
        O.tiled_attention(*qkv(11, 10), tile_size=3, causal=True)
    with pytest.raises(ValueError, match=r"v: expected S = 10 rows \(from k\), got 9"):
        O.tiled_attention(q, k, v[:9], tile_size=3)


def test_tiled_attention_reads_kv_once_and_three_pass_thrice():
    q, k, v = qkv(6, 40)
    for algorithm, k_passes in ((O.three_pass_attention, 3), (O.two_pass_attention, 2)):
        k_counter, v_counter = O.RowReadCounter(k), O.RowReadCounter(v)
        assert_close(
            algorithm(q, k_counter, v_counter, tile_size=7),
            attention(q, k, v),
            name=algorithm.__name__,
        )
        assert (k_counter.passes, v_counter.passes) == (k_passes, 1)
    k_counter, v_counter = O.RowReadCounter(k), O.RowReadCounter(v)
    O.tiled_attention(q, k_counter, v_counter, tile_size=7, query_tile_size=6)
    assert (k_counter.passes, v_counter.passes) == (1, 1)


def test_tiled_attention_memory_is_linear_in_length():
    sizes = [256, 512, 1024]
    materialised, tiled = [], []
    for n in sizes:
        q, k, v = qkv(n, n, d=32, d_v=32)
        materialised.append(peak_memory_bytes(lambda: attention(q, k, v)))
        tiled.append(peak_memory_bytes(lambda: O.tiled_attention(q, k, v, tile_size=64)))
    assert loglog_slope(sizes, materialised) == pytest.approx(2, abs=0.1)
    assert loglog_slope(sizes, tiled) < 1.2
    # the 1024 x 1024 float64 score matrix alone is 8 MiB
    assert materialised[-1] > 8 * 1024 * 1024 > 10 * tiled[-1]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 29, 40])
def test_split_k_equals_reference(num_splits):
    q, k, v = qkv(3, 29, seed=num_splits)
    assert_close(
        O.split_k_attention(q, k, v, num_splits=num_splits),
        attention(q, k, v),
        name=f"split-K ({num_splits} splits)",
        rtol=1e-12,
        atol=1e-13,
    )


def test_partial_attention_empty_and_masked_chunks_give_zero_weight():
    q, k, v = qkv(2, 6)
    out, lse = O.partial_attention(q, k[:0], v[:0])
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    masked = np.array([[False] * 3, [True, False, True]])
    out, lse = O.partial_attention(q, k[:3], v[:3], mask=masked)
    assert np.all(out[0] == 0) and np.isneginf(lse[0]) and np.isfinite(lse[1])
    rest = O.partial_attention(q, k[3:], v[3:])
    merged, merged_lse = O.merge_partials([out, rest[0]], [lse, rest[1]])
    assert np.all(np.isfinite(merged)) and np.all(np.isfinite(merged_lse))
    full_mask = np.concatenate([masked, np.ones((2, 3), dtype=bool)], axis=1)
    assert_close(merged, attention(q, k, v, full_mask), name="merge with a fully masked chunk")
    nothing, nothing_lse = O.merge_partials([out[:1]], [lse[:1]])
    assert np.all(nothing == 0) and np.isneginf(nothing_lse[0])  # all chunks empty: zeros, no NaN


chunk_sizes = st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(sizes=chunk_sizes, seed=st.integers(0, 2**16), magnitude=st.sampled_from([1.0, 30.0, 300.0]))
def test_merge_is_exact_for_any_partition(sizes, seed, magnitude):
    s = sum(sizes)
    if s == 0:
        return
    q, k, v = qkv(2, s, seed=seed)
    q = q * magnitude
    bounds = np.cumsum([0] + sizes)
    partials = [O.partial_attention(q, k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    out, lse = O.merge_partials([p[0] for p in partials], [p[1] for p in partials])
    assert_close(out, attention(q, k, v), name="merged output", rtol=1e-9, atol=1e-12)
    scores = q @ k.T / np.sqrt(8)
    assert_close(
        lse,
        scores.max(1) + np.log(np.exp(scores - scores.max(1, keepdims=True)).sum(1)),
        name="merged lse",
        rtol=1e-12,
    )


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=5), min_size=3, max_size=6),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_merge_is_associative_and_order_independent(sizes, seed, data):
    s = sum(sizes)
    q, k, v = qkv(2, s, seed=seed)
    bounds = np.cumsum([0] + sizes)
    partials = [O.partial_attention(q, k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    flat = O.merge_partials([p[0] for p in partials], [p[1] for p in partials])
    order = data.draw(st.permutations(range(len(partials))))
    shuffled = O.merge_partials([partials[i][0] for i in order], [partials[i][1] for i in order])
    left = partials[order[0]]  # ((p0 + p1) + p2) + ...: pairwise, in the shuffled order
    for i in order[1:]:
        left = O.merge_partials([left[0], partials[i][0]], [left[1], partials[i][1]])
    for name, (out, lse) in (("shuffled", shuffled), ("pairwise", left)):
        assert_close(out, flat[0], name=f"{name} merge output", rtol=1e-12, atol=1e-14)
        assert np.array_equal(np.isneginf(lse), np.isneginf(flat[1]))
        finite = np.isfinite(flat[1])
        assert_close(lse[finite], flat[1][finite], name=f"{name} merge lse", rtol=1e-12, atol=1e-14)


def test_merge_validates():
    with pytest.raises(ValueError, match="equally many"):
        O.merge_partials([np.zeros((2, 3))], [])
    with pytest.raises(ValueError, match="lses: expected shape"):
        O.merge_partials([np.zeros((2, 3))], [np.zeros(3)])


def test_accumulated_attention_recovers_probabilities_with_one_more_pass_over_k():
    rng = np.random.default_rng(11)
    q, k, v = rng.normal(size=(3, 8)) * 3, rng.normal(size=(50, 8)), rng.normal(size=(50, 4))
    _, lse = O.partial_attention(q, k, v)  # what a fused kernel keeps
    k_reads = O.RowReadCounter(k, max_rows_per_read=16)
    totals = O.accumulated_attention(q, k_reads, lse, tile_size=16)
    assert_close(totals, attention_weights(q, k).sum(axis=0), name="column sums", rtol=1e-12)
    assert k_reads.passes == 1  # the extra pass: K once more, one tile at a time
    with pytest.raises(ValueError, match=r"lse: expected \(3,\)"):
        O.accumulated_attention(q, k, lse[:2], tile_size=16)
    with pytest.raises(ValueError, match=r"k: expected \(S, 8\)"):
        O.accumulated_attention(q, k[:, :4], lse, tile_size=16)
