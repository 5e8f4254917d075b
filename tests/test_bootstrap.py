"""kvlib.metrics.bootstrap: the block bootstrap covers an autocorrelated series' true mean about as
often as it claims, where the ordinary bootstrap does not; the cluster bootstrap widens for
clustered successes; the paired cluster bootstrap resolves a difference that two unpaired
intervals do not; arguments are validated."""

import numpy as np
import pytest

from kvlib.metrics.bootstrap import (
    cluster_bootstrap,
    paired_block_bootstrap,
    paired_cluster_bootstrap,
)


def ar1(rng, n, rho, mean=1.0):
    """An AR(1) series with lag-1 correlation `rho` and the given mean."""
    x = np.empty(n)
    x[0] = rng.normal()
    for t in range(1, n):
        x[t] = rho * x[t - 1] + np.sqrt(1 - rho**2) * rng.normal()
    return mean + x


def coverage(block, rho=0.6, n=200, series=200):
    rng = np.random.default_rng(1)
    hits = 0
    for i in range(series):
        _, low, high = paired_block_bootstrap(ar1(rng, n, rho), block=block, draws=400, seed=i)
        hits += low <= 1.0 <= high
    return hits / series


def test_block_bootstrap_covers_an_autocorrelated_mean():
    blocked, naive = coverage(block=16), coverage(block=1)
    assert blocked >= 0.85  # 95% nominal; block bootstraps under-cover a little at n = 200
    assert naive < 0.8  # positions treated as independent: far too narrow
    assert blocked > naive + 0.1


def test_every_position_is_drawn_equally_often():
    """Circular blocks: the first and last positions weigh as much as the middle ones (blocks
    kept inside the text would draw them block times less often than the middle)."""
    from kvlib.metrics.bootstrap import _circular_blocks

    index = _circular_blocks(48, 8, 4000, np.random.default_rng(0))
    counts = np.bincount(index.ravel(), minlength=48) / index.shape[0]
    assert index.shape == (4000, 48)
    assert np.all(np.abs(counts - 1.0) < 0.06)


def test_paired_difference_and_determinism():
    rng = np.random.default_rng(0)
    a = ar1(rng, 300, 0.3, mean=0.5)
    b = a - 0.2 + 0.01 * rng.normal(size=300)  # b is a shifted a: a tight paired interval
    mean, low, high = paired_block_bootstrap(a, b, block=8, seed=3)
    assert mean == pytest.approx(np.mean(a - b))
    assert low < 0.2 < high and high - low < 0.01
    assert paired_block_bootstrap(a, b, block=8, seed=3) == (mean, low, high)


def test_cluster_bootstrap_widens_for_clustered_successes():
    rng = np.random.default_rng(0)
    totals = np.full(40, 4)
    independent = rng.binomial(4, 0.5, size=40)
    clustered = 4 * rng.binomial(1, 0.5, size=40)  # a document's 4 facts all right or all wrong
    rate, low, high = cluster_bootstrap(clustered, totals, seed=0)
    assert rate == pytest.approx(clustered.sum() / 160)
    _, low_i, high_i = cluster_bootstrap(independent, totals, seed=0)
    assert high - low > 1.5 * (high_i - low_i)
    assert low <= rate <= high


def test_paired_cluster_bootstrap_resolves_what_overlapping_intervals_do_not():
    """Documents of very different difficulty, shared by two caches, one of which recalls one
    fact more in a quarter of them: unpaired intervals overlap, the paired one excludes zero."""
    rng = np.random.default_rng(0)
    totals = np.full(200, 4)
    b = rng.binomial(4, rng.uniform(0.05, 0.95, size=200))  # hard and easy documents
    a = np.minimum(b + (rng.uniform(size=200) < 0.25), totals)
    difference, low, high = paired_cluster_bootstrap(a, b, totals, seed=0)
    assert difference == pytest.approx((a.sum() - b.sum()) / totals.sum())
    assert 0 < low <= difference <= high
    _, a_low, _ = cluster_bootstrap(a, totals, seed=0)
    _, _, b_high = cluster_bootstrap(b, totals, seed=0)
    assert a_low < b_high  # unpaired: the intervals overlap
    assert paired_cluster_bootstrap(b, b, totals) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: paired_block_bootstrap([1.0, 2.0], block=4), "at least block"),
        (lambda: paired_block_bootstrap([1.0, 2.0], [1.0]), "one length"),
        (lambda: paired_block_bootstrap([1.0, 2.0], block=1, level=1.0), "level"),
        (lambda: cluster_bootstrap([3, 1], [2, 2]), "successes <= totals"),
        (lambda: cluster_bootstrap([1], [2]), "length >= 2"),
        (lambda: paired_cluster_bootstrap([1, 2], [1], [2, 2]), "successes_b"),
        (lambda: paired_cluster_bootstrap([1, 3], [1, 2], [2, 2]), "successes <= totals"),
    ],
)
def test_arguments_are_validated(call, match):
    with pytest.raises(ValueError, match=match):
        call()
