"""Bootstrap intervals for measurements that are not independent (chapter 15).

Two cases recur in the course's quality measurements:

- **positions of one text**: per-position KL or top-1 agreement along a text are autocorrelated
  (a hard passage makes several neighbouring positions hard), so resampling positions one by one
  understates the spread. `paired_block_bootstrap` resamples **blocks** of consecutive positions
  (the moving-block bootstrap, Künsch, Annals of Statistics 1989), wrapped around the text's end
  so that every position is drawn equally often (the circular block bootstrap, Politis and
  Romano 1992: blocks that must fit inside the text draw its first and last positions less),
  and resamples the same blocks for the two methods compared, so the interval is for their
  **difference** on the same text;
- **items grouped in documents**: recall facts come several to a document, and a document that is
  hard for one fact is often hard for the others. `cluster_bootstrap` resamples whole documents
  (clusters) and recomputes the pooled rate; `paired_cluster_bootstrap` resamples the same
  documents for two caches measured on them, for the difference of their rates.

All are percentile intervals over `draws` resamples from a seeded generator: the same interval
on every run.
"""

from __future__ import annotations

import numpy as np

from kvlib._validate import check_positive_int

__all__ = ["cluster_bootstrap", "paired_block_bootstrap", "paired_cluster_bootstrap"]


def _percentiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    """The percentile interval of a bootstrap's `samples` at coverage `level`."""
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def _check_level(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: expected a number in (0, 1), got {level!r}")
    return float(level)


def paired_block_bootstrap(
    a,
    b=None,
    *,
    block: int = 8,
    draws: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The mean of `a - b` (or of `a` when `b` is None) over positions, and its moving-block
    bootstrap percentile interval.

    Args:
        a, b: (N,) per-position values of two methods on the same positions, in text order
            (e.g. KL in nats per position); b None: an interval for the mean of `a` alone.
        block: consecutive positions per resampled block (1: the ordinary bootstrap, which
            assumes independent positions); blocks start anywhere in 0 .. N - 1 and wrap
            around the end (circular), so every position has the same weight.
        draws: resamples; level: the interval's coverage (0.95: the 2.5th to 97.5th percentile).
        seed: of the generator.
    Returns:
        (mean, low, high), floats in the values' units.
    Raises:
        ValueError: a or b not 1-D, different lengths, fewer than `block` positions, a level
        outside (0, 1); TypeError, ValueError: block or draws not a positive int.
    """
    a = np.asarray(a, dtype=np.float64)
    b = a * 0 if b is None else np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or b.shape != a.shape:
        raise ValueError(
            f"a, b: expected two 1-D arrays of one length, got shapes {a.shape} and {b.shape}"
        )
    diff = a - b
    block = check_positive_int("block", block)
    draws = check_positive_int("draws", draws)
    level = _check_level(level)
    n = len(diff)
    if n < block:
        raise ValueError(f"a: expected at least block = {block} positions, got {n}")
    means = diff[_circular_blocks(n, block, draws, np.random.default_rng(seed))].mean(axis=1)
    low, high = _percentiles(means, level)
    return float(diff.mean()), float(low), float(high)


def _circular_blocks(n: int, block: int, draws: int, rng) -> np.ndarray:
    """(draws, n) positions: each row blocks of `block` consecutive positions from uniform
    starts, wrapped around n, cut back to n positions."""
    per_draw = -(-n // block)
    starts = rng.integers(0, n, size=(draws, per_draw))
    return ((starts[:, :, None] + np.arange(block)) % n).reshape(draws, -1)[:, :n]


def _resampled_clusters(names: str, successes, totals, draws, level, seed):
    """`successes` (one or more (C,) arrays) and `totals` checked and as float arrays, and
    `draws` resamples of whole clusters: (successes, totals, picks (draws, C), level). `names`:
    the arguments, for the errors (see `cluster_bootstrap`)."""
    counts = [np.asarray(s, dtype=np.float64) for s in successes]
    total = np.asarray(totals, dtype=np.float64)
    shapes = [c.shape for c in (*counts, total)]
    if counts[0].ndim != 1 or len(set(shapes)) > 1 or len(total) < 2:
        words = {2: "two", 3: "three"}[len(shapes)]
        listed = ", ".join(map(str, shapes[:-1])) + f" and {shapes[-1]}"
        raise ValueError(
            f"{names}: expected {words} 1-D arrays of one length >= 2, got shapes {listed}"
        )
    if (total <= 0).any() or any((c < 0).any() or (c > total).any() for c in counts):
        raise ValueError(f"{names}: expected 0 <= successes <= totals and totals > 0")
    draws = check_positive_int("draws", draws)
    level = _check_level(level)
    picks = np.random.default_rng(seed).integers(0, len(total), size=(draws, len(total)))
    return counts, total, picks, level


def cluster_bootstrap(
    successes,
    totals,
    *,
    draws: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The pooled rate `sum(successes) / sum(totals)` over clusters (documents) and its cluster
    bootstrap percentile interval: whole clusters resampled with replacement.

    Args:
        successes, totals: (C,) per cluster, e.g. facts recalled and facts asked per document;
            0 <= successes <= totals, totals > 0.
        draws, level, seed: as `paired_block_bootstrap`.
    Returns:
        (rate, low, high), fractions in [0, 1].
    Raises:
        ValueError: arrays that are not 1-D of one length (at least 2 clusters), counts out of
        range, a level outside (0, 1); TypeError, ValueError: draws not a positive int.
    """
    (hits,), total, picks, level = _resampled_clusters(
        "successes, totals", (successes,), totals, draws, level, seed
    )
    rates = hits[picks].sum(axis=1) / total[picks].sum(axis=1)
    low, high = _percentiles(rates, level)
    return float(hits.sum() / total.sum()), float(low), float(high)


def paired_cluster_bootstrap(
    successes_a,
    successes_b,
    totals,
    *,
    draws: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The difference of two pooled rates measured on the same clusters (documents), A minus B,
    and its paired cluster bootstrap percentile interval: the same clusters resampled for both,
    so what makes a document hard for both cancels (two unpaired intervals that overlap can still
    be a resolved paired difference).

    Args:
        successes_a, successes_b: (C,) per cluster, e.g. facts recalled by two caches per document.
        totals: (C,) per cluster, what both were asked; 0 <= successes <= totals, totals > 0.
        draws, level, seed: as `paired_block_bootstrap`.
    Returns:
        (difference, low, high), in rate units (fractions).
    Raises:
        ValueError: arrays that are not 1-D of one length (at least 2 clusters), counts out of
        range, a level outside (0, 1); TypeError, ValueError: draws not a positive int.
    """
    (a, b), total, picks, level = _resampled_clusters(
        "successes_a, successes_b, totals", (successes_a, successes_b), totals, draws, level, seed
    )
    differences = (a[picks].sum(axis=1) - b[picks].sum(axis=1)) / total[picks].sum(axis=1)
    low, high = _percentiles(differences, level)
    return float((a.sum() - b.sum()) / total.sum()), float(low), float(high)
