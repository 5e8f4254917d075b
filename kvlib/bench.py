"""Timing helpers for the notebooks' Measure sections.

Wall-clock timing on a CPU is noisy; the notebooks plot these numbers and assert only ratios with
wide margins, never print raw timings (COURSE.md, Determinism). GPU benchmarks use
`triton.testing.do_bench` instead.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from kvlib._validate import check_positive_int


def median_time_ms(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` in milliseconds over `repeats` calls, after `warmup` untimed calls.

    The median (not the mean) so that one interruption by the operating system does not move it.

    Raises:
        TypeError: `fn` is not callable. ValueError: repeats < 1 or warmup < 0.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    repeats = check_positive_int("repeats", repeats)
    warmup = check_positive_int("warmup", warmup, allow_zero=True)
    for _ in range(warmup):
        fn()
    times_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times_ms.append((time.perf_counter() - start) * 1e3)
    times_ms.sort()
    return times_ms[len(times_ms) // 2]


def loglog_slope(sizes, values) -> float:
    """Least-squares slope of log(values) against log(sizes): the exponent k in values ~ sizes^k."""
    sizes, values = np.asarray(sizes, dtype=float), np.asarray(values, dtype=float)
    if sizes.shape != values.shape or sizes.ndim != 1 or sizes.size < 2:
        raise ValueError(f"sizes, values: expected two 1-D arrays of equal length >= 2, got {sizes.shape} and {values.shape}")
    if np.any(sizes <= 0) or np.any(values <= 0):
        raise ValueError("sizes, values: a log-log fit needs positive numbers")
    slope, _ = np.polyfit(np.log(sizes), np.log(values), 1)
    return float(slope)


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated while `fn()` runs, above what was allocated before, by tracemalloc.

    numpy reports its array buffers to tracemalloc, so this measures the temporaries an algorithm
    creates (a score matrix, a tile), not the inputs that already exist.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return peak - before
