"""Timing helpers for the notebooks' Measure sections.

Wall-clock timing on a CPU is noisy, and a learner's laptop is rarely idle. The notebooks time
contenders interleaved (`interleaved_times_ms`), compare minima, plot the numbers and assert only
ratios with margins that hold with one core busy; they never print raw timings (COURSE.md,
Determinism). GPU benchmarks use
`triton.testing.do_bench` instead.
"""

from __future__ import annotations

import functools
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
    from torch.profiler import ProfilerActivity, profile

    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    # the profiler's C++ side logs its start and stop to file descriptor 2 with a timestamp:
    # silence it, so that a notebook's stored output stays the same on every run
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    return sum(max(0, e.self_cpu_memory_usage) for e in profiler.events())


# --- the decode-attention benchmark: `python -m kvlib.course.bench decode` -----------------------

# Peak memory bandwidth in GB/s from the vendors' datasheets, matched against the device name.
PEAK_BANDWIDTH_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100-SXM4-40GB": 1555.0,
    "L40S": 864.0,
}

# (H, H_kv): Llama-3-8B's GQA first, then GQA-8 with 4 KV heads, Llama-3-70B's 64/8, and MHA
DECODE_HEADS = [(32, 8), (32, 4), (64, 8), (32, 32)]
DECODE_BATCHES = [1, 8, 64]
DECODE_CONTEXTS = [1024, 4096, 16384, 32768, 65536, 131072]


def decode_lengths(batch_size: int, context: int, ragged: bool, seed: int = 0) -> list[int]:
    """Sequence lengths of one benchmark case: all `context`, or uniform in [context/2, context]."""
    if not ragged:
        return [context] * batch_size
    rng = np.random.default_rng(seed + batch_size * 7919 + context)
    return [int(n) for n in rng.integers(context // 2, context + 1, size=batch_size)]


def kv_bytes_read(
    lengths: list[int], num_kv_heads: int, head_dim: int, bytes_per_element: int
) -> int:
    """Bytes of K and V a decode step must read, once per KV head: Σ_b S_b · 2 · H_kv · D · b
    (one layer's dense cache of all the batch's tokens, `memory.formula.dense_kv_cache_bytes`)."""
    from kvlib.memory.formula import dense_kv_cache_bytes

    return dense_kv_cache_bytes(1, num_kv_heads, head_dim, bytes_per_element, sum(lengths))


def decode_cases(quick: bool = False) -> list[dict]:
    """Every (heads, batch, context, ragged) case of the benchmark, with its cache size."""
    cases = []
    heads = DECODE_HEADS[:1] if quick else DECODE_HEADS
    contexts = [4096, 32768] if quick else DECODE_CONTEXTS
    for num_heads, num_kv_heads in heads:
        for batch in [1, 8] if quick else DECODE_BATCHES:
            for context in contexts:
                for ragged in (False, True):
                    lengths = decode_lengths(batch, context, ragged)
                    cases.append(
                        dict(
                            num_heads=num_heads,
                            num_kv_heads=num_kv_heads,
                            head_dim=128,
                            batch=batch,
                            context=context,
                            ragged=ragged,
                            lengths=lengths,
                            cache_bytes=kv_bytes_read(lengths, num_kv_heads, 128, 2),
                        )
                    )
    return cases


def _device_facts() -> dict:
    import subprocess

    import torch
    import triton

    name = torch.cuda.get_device_name()
    try:
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.split("\n")[0]
            .strip()
        )
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    peak = next((gbps for key, gbps in PEAK_BANDWIDTH_GBPS.items() if key in name), float("nan"))
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "driver": driver,
        "peak_gbps": peak,
    }


def copy_bandwidth_gbps(num_bytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes / time), by do_bench."""
    import torch
    from triton.testing import do_bench

    source = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    time_ms = do_bench(lambda: target.copy_(source), warmup=10, rep=100, return_mode="median")
    return 2 * num_bytes / (time_ms * 1e-3) / 1e9


def _write_rows(out_csv: str, rows: list[dict]) -> list[dict]:
    """Write `rows` (dicts with the same keys) to `out_csv` with a header; return them."""
    import csv

    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def paged_decode_inputs(lengths, num_heads, num_kv_heads, head_dim, block_size):
    """Random bf16 inputs of one decode step on the GPU: q (B, H, D); a paged cache (num_blocks,
    block_size, H_kv, D) twice (K, V) with shuffled block tables; seq_lens (B,) int32."""
    import torch

    from kvlib.cache.block_table import shuffled_block_tables

    generator = torch.Generator(device="cuda").manual_seed(0)
    block_tables, num_blocks = shuffled_block_tables(
        lengths, block_size, generator=generator, device="cuda"
    )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(len(lengths), num_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, block_tables, seq_lens


def _sdpa_baseline(q, k_dense, v_dense, lengths):
    """SDPA on a contiguous (B, H_kv, S_max, D) cache with enable_gqa; returns (callable, backend
    name)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = None
    if len(set(lengths)) > 1:  # ragged: a padding mask (rules out the flash backend)
        positions = torch.arange(k_dense.shape[2], device=q.device)
        mask = (positions[None, :] < torch.tensor(lengths, device=q.device)[:, None])[
            :, None, None, :
        ]
    query = q[:, :, None, :]  # (B, H, 1, D)
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):

        def run(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(
                    query, k_dense, v_dense, attn_mask=mask, enable_gqa=True
                )

        try:
            run()
        except RuntimeError:
            continue
        return run, backend.name
    raise RuntimeError("no SDPA backend accepted these shapes")


def decode_benchmark(
    out_csv: str, *, quick: bool = False, memory_fraction: float = 0.35
) -> list[dict]:
    """Time `paged_decode_attention` and SDPA on every case that fits; write and return the rows.

    Each case: bf16, D = 128, block size 16, shuffled block tables. Time: `triton.testing.do_bench`
    median (it clears the L2 cache before each run). GB/s: `kv_bytes_read` / time, the bytes of the
    sequences' own tokens for both contenders (`bytes_read`); `bytes_loaded` is what each loads:
    SDPA's contiguous cache of a ragged batch is padded to its longest sequence.
    """
    import datetime
    import functools

    import torch
    from tqdm import tqdm
    from triton.testing import do_bench

    from kvlib.kernels import DecodeWorkspace, default_num_splits, paged_decode_attention

    facts = _device_facts()
    copy_gbps = copy_bandwidth_gbps()
    budget = torch.cuda.get_device_properties(0).total_memory * memory_fraction
    date = datetime.date.today().isoformat()
    rows = []
    for case in tqdm(decode_cases(quick), desc="decode cases", unit="case"):
        lengths, block_size = case["lengths"], 16
        if case["cache_bytes"] > budget:  # paged + contiguous copies must both fit
            continue
        inputs = paged_decode_inputs(
            lengths, case["num_heads"], case["num_kv_heads"], case["head_dim"], block_size
        )
        q = inputs[0]
        num_splits = default_num_splits(len(lengths), case["num_kv_heads"], max(lengths), q.device)
        # validates once
        paged_decode_attention(*inputs, num_splits=num_splits)
        paged = functools.partial(  # the hot path: no sync, no allocation
            paged_decode_attention,
            *inputs,
            num_splits=num_splits,
            validate=False,
            out=torch.empty_like(q),
            workspace=DecodeWorkspace.allocate(
                len(lengths),
                case["num_heads"],
                case["head_dim"],
                max_splits=num_splits,
                device="cuda",
            ),
        )  # binds the tensors now, so the `del` below frees them once timed
        timings = {
            "triton_paged": (
                do_bench(paged, warmup=25, rep=100, return_mode="median"),
                f"splits={num_splits}",
            )
        }
        k_dense = torch.randn(
            len(lengths),
            case["num_kv_heads"],
            max(lengths),
            case["head_dim"],
            dtype=torch.bfloat16,
            device="cuda",
        )
        v_dense = torch.randn_like(k_dense)
        sdpa, backend = _sdpa_baseline(q, k_dense, v_dense, lengths)
        timings["sdpa_contiguous"] = (
            do_bench(sdpa, warmup=25, rep=100, return_mode="median"),
            backend,
        )
        del k_dense, v_dense, inputs, paged, sdpa
        for kernel, (time_ms, detail) in timings.items():
            gbps = case["cache_bytes"] / (time_ms * 1e-3) / 1e9
            rows.append(
                {
                    **facts,
                    "date": date,
                    "kernel": kernel,
                    "detail": detail,
                    "heads_q": case["num_heads"],
                    "heads_kv": case["num_kv_heads"],
                    "head_dim": case["head_dim"],
                    "dtype": "bfloat16",
                    "block_size": block_size,
                    "batch": case["batch"],
                    "context": case["context"],
                    "ragged": case["ragged"],
                    "mean_len": round(float(np.mean(lengths)), 1),
                    "time_us": round(time_ms * 1e3, 2),
                    "bytes_read": case["cache_bytes"],
                    "bytes_loaded": (
                        case["cache_bytes"]
                        if kernel == "triton_paged"
                        else kv_bytes_read(
                            [max(lengths)] * len(lengths), case["num_kv_heads"], case["head_dim"], 2
                        )
                    ),
                    "gbps": round(gbps, 1),
                    "pct_of_peak": round(100 * gbps / facts["peak_gbps"], 1),
                    "copy_gbps": round(copy_gbps, 1),
                    "pct_of_copy": round(100 * gbps / copy_gbps, 1),
                }
            )
        torch.cuda.empty_cache()
    return _write_rows(out_csv, rows)


class _FakeLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **options)` does nothing, so a
    CPU timer sees only the wrapper's own Python path."""

    def __getitem__(self, grid):
        return lambda *args, **options: None


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
    never inside it. `fake_launch` replaces the two Triton launches with no-ops: what remains is
    the wrapper's own Python (checks, plan cache, allocations), which a CPU can measure.
    """
    import torch

    import kvlib.kernels as kernels

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
        options["workspace"] = kernels.DecodeWorkspace.allocate(1, 32, 128, device=device)
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


TUNE_SHAPES = [  # (batch, H, H_kv, context): few, many and very many (sequence, KV head) pairs
    (batch, num_heads, num_kv_heads, context)
    for batch, num_heads, num_kv_heads in [(1, 32, 8), (1, 32, 32), (8, 32, 8), (64, 32, 8)]
    for context in (4096, 32768, 131072)
]


def tune_decode(out_csv: str) -> list[dict]:
    """Time `paged_decode_attention` over split count x BLOCK_N x num_warps x num_stages on each
    `TUNE_SHAPES` case (bf16, D = 128, block size 16); write every timing to `out_csv`.

    The sweep is recorded, not applied at run time: `kernels.default_num_splits` and the
    kernel's defaults freeze what it found, so CPU runs stay deterministic.
    """
    import datetime
    import functools
    import itertools

    import torch
    from tqdm import tqdm
    from triton.testing import do_bench

    from kvlib.kernels import DecodeWorkspace, paged_decode_attention

    facts = {**_device_facts(), "date": datetime.date.today().isoformat()}
    copy_gbps = copy_bandwidth_gbps()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = list(itertools.product([1, 2, 4, 8, 16, 32, 64], [32, 64, 128], [4, 8], [2, 3]))
    rows = []
    for batch, num_heads, num_kv_heads, context in tqdm(TUNE_SHAPES, desc="tune", unit="shape"):
        lengths = [context] * batch
        inputs = paged_decode_inputs(lengths, num_heads, num_kv_heads, 128, 16)
        cache_bytes = kv_bytes_read(lengths, num_kv_heads, 128, 2)
        out = torch.empty_like(inputs[0])
        workspace = DecodeWorkspace.allocate(batch, num_heads, 128, device="cuda")  # 64 splits
        for num_splits, block_n, num_warps, num_stages in grid:
            run = functools.partial(
                paged_decode_attention,
                *inputs,
                num_splits=num_splits,
                block_n=block_n,
                num_warps=num_warps,
                num_stages=num_stages,
                validate=False,
                out=out,
                workspace=workspace,
            )
            time_ms = do_bench(run, warmup=10, rep=40, return_mode="median")
            gbps = cache_bytes / (time_ms * 1e-3) / 1e9
            rows.append(
                {
                    **facts,
                    "num_sms": num_sms,
                    "batch": batch,
                    "heads_q": num_heads,
                    "heads_kv": num_kv_heads,
                    "context": context,
                    "num_splits": num_splits,
                    "block_n": block_n,
                    "num_warps": num_warps,
                    "num_stages": num_stages,
                    "time_us": round(time_ms * 1e3, 2),
                    "gbps": round(gbps, 1),
                    "pct_of_copy": round(100 * gbps / copy_gbps, 1),
                }
            )
        del inputs, run, out, workspace
        torch.cuda.empty_cache()
    return _write_rows(out_csv, rows)


# --- A/B of the kernel at two commits: `python -m kvlib.course.bench ab --base e40ecea` ---------

# (batch, H, H_kv, context), uniform: issue 36's regressed shapes and its missed targets
AB_SHAPES = [
    (1, 32, 8, 4096),
    (1, 32, 8, 65536),
    (1, 32, 4, 65536),
    (8, 32, 8, 16384),
    (8, 32, 8, 32768),
    (8, 32, 4, 16384),
    (8, 32, 32, 32768),
    (64, 32, 8, 16384),
]


def load_kernels_at(rev: str, workdir: str):
    """`kvlib/kernels.py` as of git revision `rev`, imported as its own module (`kernels_<rev>`)
    from a detached `git worktree` under `workdir` (the caller removes it with
    `remove_worktree`). Its own `kvlib.*` imports resolve to the current package, so pass
    `num_splits` explicitly (old versions chose it through modules since moved)."""
    import importlib.util
    import subprocess

    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
    ).stdout.strip()
    tree = os.path.join(workdir, f"kvlib-{rev}")
    subprocess.run(
        ["git", "-C", root, "worktree", "add", "--detach", tree, rev],
        capture_output=True,
        text=True,
        check=True,
    )
    spec = importlib.util.spec_from_file_location(
        f"kernels_{rev}", os.path.join(tree, "kvlib", "kernels.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # @triton.jit reads the source through inspect
    spec.loader.exec_module(module)
    module.WORKTREE = tree
    return module


def remove_worktree(module) -> None:
    """Remove the worktree `load_kernels_at` made for `module`."""
    import subprocess

    subprocess.run(
        ["git", "worktree", "remove", "--force", module.WORKTREE], capture_output=True, text=True
    )


def ab_decode(out_csv: str, base: str = "e40ecea", *, rounds: int = 5) -> list[dict]:
    """The kernel at `base` against the working tree's, interleaved on one GPU in one run, with
    the same inputs and the same split counts (the working tree's `default_num_splits`).

    Per shape, version and round: GPU time from CUDA-graph replay
    (`triton.testing.do_bench_cudagraph`: no host cost), `do_bench`'s time (what
    `results/decode_bench.csv` recorded), and host time (a CPU timer over 1,000 calls of
    `validate=False` with `num_splits` given, the device synchronized only around them). Rows
    hold each round's numbers; compare medians. Outputs of the two versions are checked equal
    first (bf16 tolerance).
    """
    import datetime
    import subprocess
    import tempfile

    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    import kvlib.kernels as head
    from kvlib.testing import assert_close

    facts = {**_device_facts(), "date": datetime.date.today().isoformat()}
    head_rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
    head_label = head_rev + ("+dirty" if dirty.stdout.strip() else "")
    copy_gbps = copy_bandwidth_gbps()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        old = load_kernels_at(base, workdir)
        try:
            for batch, num_heads, num_kv_heads, context in AB_SHAPES:
                lengths = [context] * batch
                inputs = paged_decode_inputs(lengths, num_heads, num_kv_heads, 128, 16)
                num_splits = head.default_num_splits(batch, num_kv_heads, context, "cuda")
                cache_bytes = kv_bytes_read(lengths, num_kv_heads, 128, 2)
                versions = {
                    base: functools.partial(
                        old.paged_decode_attention, *inputs, num_splits=num_splits, validate=False
                    ),
                    head_label: functools.partial(
                        head.paged_decode_attention, *inputs, num_splits=num_splits, validate=False
                    ),
                }
                assert_close(
                    versions[head_label](),
                    versions[base](),
                    name=f"{head_label} vs {base}",
                    rtol=2e-2,
                    atol=2e-2,
                )
                for round_ in range(rounds):
                    for version, fn in versions.items():
                        graph_ms = do_bench_cudagraph(fn, rep=50, return_mode="median")
                        bench_ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        for _ in range(1000):
                            fn()
                        host_us = (time.perf_counter() - start) * 1e3  # per call: / 1000
                        torch.cuda.synchronize()
                        rows.append(
                            {
                                **facts,
                                "version": version,
                                "round": round_,
                                "batch": batch,
                                "heads_q": num_heads,
                                "heads_kv": num_kv_heads,
                                "context": context,
                                "num_splits": num_splits,
                                "graph_us": round(graph_ms * 1e3, 2),
                                "do_bench_us": round(bench_ms * 1e3, 2),
                                "host_us": round(host_us, 2),
                                "graph_pct_of_copy": round(
                                    100 * cache_bytes / (graph_ms * 1e-3) / 1e9 / copy_gbps, 1
                                ),
                                "copy_gbps": round(copy_gbps, 1),
                            }
                        )
                del inputs, versions
                torch.cuda.empty_cache()
        finally:
            remove_worktree(old)
    return _write_rows(out_csv, rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.course.bench decode [--out CSV] [--quick] [--dry-run]`, `tune [--out CSV]`,
    `ab [--base REV] [--out CSV]`, `host [--calls N]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvlib.course.bench", description="Benchmarks that need a GPU."
    )
    sub = parser.add_subparsers(dest="benchmark", required=True)
    decode = sub.add_parser(
        "decode", help="paged decode attention vs SDPA, GB/s against the copy bandwidth"
    )
    decode.add_argument(
        "--out",
        default="results/decode_bench.csv",
        help="CSV to write (default results/decode_bench.csv)",
    )
    decode.add_argument("--quick", action="store_true", help="a handful of shapes only")
    decode.add_argument(
        "--dry-run",
        action="store_true",
        help="list the cases and their cache sizes; time nothing (no GPU needed)",
    )
    tune = sub.add_parser("tune", help="sweep the kernel's launch options on a few shapes")
    tune.add_argument("--out", default="results/decode_tuning.csv", help="CSV to write")
    ab = sub.add_parser("ab", help="the kernel at a base commit against the working tree's")
    ab.add_argument("--base", default="e40ecea", help="git revision to compare against")
    ab.add_argument("--out", default="decode_ab.csv", help="CSV to write (every round's numbers)")
    host = sub.add_parser(
        "host", help="host time of one hot call (a fake launch on a CPU, real on a GPU)"
    )
    host.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.benchmark == "host":
        import torch

        fake = decode_host_time_us("cpu", fake_launch=True, calls=args.calls)
        print(f"wrapper's Python path, launches faked, CPU: {fake:.1f} us per call")
        if torch.cuda.is_available():
            real = decode_host_time_us("cuda", calls=args.calls)
            print(f"host time per call on {torch.cuda.get_device_name()}: {real:.1f} us")
        return 0
    if args.benchmark == "ab":
        import torch

        if not torch.cuda.is_available():
            parser.error("ab needs a CUDA GPU")
        rows = ab_decode(args.out, args.base)
        for version in dict.fromkeys(r["version"] for r in rows):
            print(version)
            for shape in dict.fromkeys(AB_SHAPES):
                mine = [
                    r
                    for r in rows
                    if r["version"] == version
                    and (r["batch"], r["heads_q"], r["heads_kv"], r["context"]) == shape
                ]
                median = {
                    key: float(np.median([r[key] for r in mine]))
                    for key in ("graph_us", "do_bench_us", "host_us", "graph_pct_of_copy")
                }
                print(f"  {shape}: " + ", ".join(f"{k} {v:.1f}" for k, v in median.items()))
        print(f"wrote {len(rows)} rows to {args.out}")
        return 0
    if args.benchmark == "tune":
        import pathlib

        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {len(tune_decode(args.out))} rows to {args.out}")
        return 0
    if args.dry_run:
        for case in decode_cases(args.quick):
            print(
                f"H={case['num_heads']:>2} H_kv={case['num_kv_heads']:>2} "
                f"batch={case['batch']:>2} context={case['context']:>6} "
                f"{'ragged' if case['ragged'] else 'uniform':<7} K+V bytes={case['cache_bytes']:,}"
            )
        return 0
    import torch

    if not torch.cuda.is_available():
        parser.error("decode needs a CUDA GPU (try --dry-run to list the cases)")
    import pathlib

    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = decode_benchmark(args.out, quick=args.quick)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
