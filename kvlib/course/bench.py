"""Timing helpers for the notebooks' Measure sections.

Wall-clock timing on a CPU is noisy, and a learner's laptop is rarely idle. The notebooks time
contenders interleaved (`interleaved_times_ms`; `stable_times_ms` repeats that until two
measurements agree), compare minima, plot the numbers and assert only ratios with margins that
hold with one core busy, and only when the measurements agreed; they never print raw timings
(COURSE.md, Determinism). `decode_host_time_us` measures the decode wrapper's host path
(`python -m kvlib.course.bench host`). GPU benchmarks, which write recorded results, are
experiments (`kvlib.experiments.decode_bench`, `decode_tuning`) and use `triton.testing.do_bench`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import tracemalloc
from collections.abc import Callable, Mapping
from types import SimpleNamespace

import numpy as np

from kvlib._validate import check_positive_int


def interleaved_times_ms(
    fns: Mapping[str, Callable[[], object]], *, repeats: int = 5, warmup: int = 1
) -> dict[str, list[float]]:
    """Wall times of several callables in milliseconds, measured interleaved: A B A B ...

    Each round calls every function once, in the order given, so a slow spell of the machine
    (another process, a frequency change) hits every contender alike instead of one of them.
    Compare the results by their minimum (`min(times)`) or median, never by one run.

    Args:
        fns: name -> a callable of no arguments (at least one).
        repeats: timed rounds (>= 1).
        warmup: untimed rounds first (>= 0).
    Returns:
        name -> the `repeats` times in ms, in the order measured.
    Raises:
        TypeError: a value of `fns` is not callable. ValueError: `fns` is empty, repeats < 1 or
            warmup < 0.
    """
    if not fns:
        raise ValueError("fns: expected at least one callable, got none")
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"fns[{name!r}]: expected a callable, got {type(fn).__name__}")
    repeats = check_positive_int("repeats", repeats)
    warmup = check_positive_int("warmup", warmup, allow_zero=True)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times_ms: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times_ms[name].append((time.perf_counter() - start) * 1e3)
    return times_ms


def stable_times_ms(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int = 5,
    warmup: int = 2,
    agree: float = 0.2,
    cap_s: float = 4.0,
    deadline: float | None = None,
) -> tuple[dict[str, float], bool]:
    """Each callable's fastest of `repeats` interleaved runs (`interleaved_times_ms`, after
    `warmup` rounds), measured again until two successive measurements agree within `agree`
    (relative) for every contender, or `cap_s` seconds pass, or `deadline` (a
    `time.perf_counter()` value, for a cell's whole budget) does.

    The notebooks assert a timing only when it is stable: on a busy machine they say so in the
    plot's title instead of failing.

    Returns:
        (name -> ms, stable): the faster of the two agreeing measurements and True; else the last
        measurement and False (past `deadline` already: one round without warm-up, and False).
    Raises:
        ValueError: `agree` or `cap_s` not positive, or what `interleaved_times_ms` raises.
    """
    if not agree > 0 or not cap_s > 0:
        raise ValueError(f"agree, cap_s: expected positive numbers, got {agree} and {cap_s}")
    start, best = time.perf_counter(), None
    if deadline is not None and start > deadline:  # bound the cell's time, not the measurement's
        return {n: t[0] for n, t in interleaved_times_ms(fns, repeats=1).items()}, False
    while True:
        times = interleaved_times_ms(fns, repeats=repeats, warmup=warmup if best is None else 0)
        now = {name: min(t) for name, t in times.items()}
        if best is not None and all(abs(now[n] / best[n] - 1) < agree for n in now):
            return {n: min(now[n], best[n]) for n in now}, True
        elapsed = time.perf_counter()
        if elapsed - start > cap_s or (deadline is not None and elapsed > deadline):
            return now, False
        best = now


def loglog_slope(sizes, values) -> float:
    """Least-squares slope of log(values) against log(sizes): the exponent k in values ~ sizes^k."""
    sizes, values = np.asarray(sizes, dtype=float), np.asarray(values, dtype=float)
    if sizes.shape != values.shape or sizes.ndim != 1 or sizes.size < 2:
        raise ValueError(
            f"sizes, values: expected two 1-D arrays of equal length >= 2, got {sizes.shape} and "
            f"{values.shape}"
        )
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


def torch_allocated_bytes(fn: Callable[[], object]) -> int:
    """Total bytes PyTorch's CPU allocator hands out while `fn()` runs (every allocation counted,
    frees ignored: the traffic of temporaries, not the peak), from `torch.profiler`'s memory
    events. numpy's tracemalloc (`peak_memory_bytes`) does not see torch tensors; this does.

    Raises:
        TypeError: fn is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    with quiet_profiler(profile_memory=True) as profiler:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in profiler.events())


def operator_time_share(fn: Callable[[], object], names) -> float:
    """The fraction of `fn()`'s operator time (torch's CPU profiler: each operator's own time,
    its callees' excluded) spent in the operators `names` (such as "aten::mm"), in [0, 1].

    Raises:
        TypeError: fn is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    with quiet_profiler() as profiler:
        fn()
    own_us = {e.key: e.self_cpu_time_total for e in profiler.key_averages()}
    return sum(us for name, us in own_us.items() if name in set(names)) / sum(own_us.values())


@contextlib.contextmanager
def quiet_profiler(**options):
    """torch's CPU profiler (`torch.profiler.profile` with `options`), its C++ side's start and
    stop lines (written to file descriptor 2 with a timestamp) silenced, so that a notebook's
    stored output stays the same on every run."""
    from torch.profiler import ProfilerActivity, profile

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        with profile(activities=[ProfilerActivity.CPU], **options) as profiler:
            yield profiler
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# --- the decode wrapper's host time: `python -m kvlib.course.bench host`
# ---------------------------


class _FakeCompiled:
    """Stands in for the compiled kernel a Triton launch returns: its launcher does nothing."""

    function = packed_metadata = None

    @staticmethod
    def run(*args):
        return None


class _FakeLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **options)` does nothing and
    returns `_FakeCompiled`, which the wrapper then launches directly as it launches a compiled
    kernel on a GPU (`kvlib.ops.direct_launch`), so a CPU timer sees only the wrapper's own
    Python path."""

    def __getitem__(self, grid):
        return lambda *args, **options: _FakeCompiled


def decode_host_time_us(
    device: str = "cpu",
    *,
    fake_launch: bool = False,
    calls: int = 1000,
    rounds: int = 5,
    validate: bool = False,
    preallocated: bool = True,
) -> float:
    """Host time of one `paged_decode_attention` call on the hot path, in µs: the least over
    `rounds` of a CPU timer around `calls` calls, divided by `calls` (issue 36's measure).

    The hot path: `validate=False`, `num_splits` given, and (`preallocated`) the caller's `out`
    and `DecodeWorkspace`. The shape is a small decode step (batch 1, 32/8 heads, D = 128, 16
    tokens), so that on a GPU each call's kernels take less time than its host path and the
    timer measures the host. On a GPU the device is synchronized before and after each round,
    never inside it. `fake_launch` replaces the Triton kernels with stand-ins whose launches do
    nothing: what remains is the wrapper's own Python (checks, plan cache, allocations, the
    direct launch's arguments), which a CPU can measure.
    """
    import torch

    import kvlib.kernels as kernels
    from kvlib.ops.decode_plan import DecodeWorkspace

    calls = check_positive_int("calls", calls)
    rounds = check_positive_int("rounds", rounds)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 128, generator=generator).to(device, torch.bfloat16)
    k_cache = torch.randn(4, 16, 8, 128, generator=generator).to(device, torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([16], dtype=torch.int32, device=device)
    options = dict(validate=validate, num_splits=1)
    if preallocated:
        options["out"] = torch.empty_like(q)
        options["workspace"] = DecodeWorkspace.allocate(1, 32, 128, device=device)
    saved = kernels._KERNELS
    if fake_launch:
        kernels._KERNELS = SimpleNamespace(
            _decode_split_kernel=_FakeLaunch(), _reduce_splits_kernel=_FakeLaunch()
        )
    try:

        def call():
            kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **options)

        def synchronize():
            if q.device.type == "cuda":
                torch.cuda.synchronize()

        for _ in range(min(calls, 100)):  # compile, fill the plan cache, warm up
            call()
        best = float("inf")
        for _ in range(rounds):
            synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            best = min(best, time.perf_counter() - start)
            synchronize()
    finally:
        kernels._KERNELS = saved
    return best / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.course.bench host [--calls N]`: the host time of one hot call of
    `paged_decode_attention` (a fake launch on a CPU, real on a GPU)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvlib.course.bench", description="Host time of the decode wrapper."
    )
    sub = parser.add_subparsers(dest="benchmark", required=True)
    host = sub.add_parser(
        "host", help="host time of one hot call (a fake launch on a CPU, real on a GPU)"
    )
    host.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args(argv)
    import torch

    from kvlib.ops.devices import kernel_device

    # the kernel's own device: where it is compiled, the wrapper refuses CPU tensors
    device = kernel_device()
    fake = decode_host_time_us(str(device), fake_launch=True, calls=args.calls)
    print(f"wrapper's Python path, launches faked, {device.type} tensors: {fake:.1f} us per call")
    if torch.cuda.is_available():
        real = decode_host_time_us("cuda", calls=args.calls)
        print(f"host time per call on {torch.cuda.get_device_name()}: {real:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
