"""Device facts and timers of the GPU recordings (`decode_bench`, `decode_tuning`, `serving_gpu`,
`smollm2_steps`): the device, versions, driver and commit a recording names; a call's median time
(`triton.testing.do_bench` on a GPU, a wall clock on the CPU); its GPU time by CUDA-graph replay;
the copy bandwidth every bandwidth is compared with."""

from __future__ import annotations

import numpy as np

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


GRAPH_CALLS = 20  # calls captured in one CUDA graph for `graph_us`


def device_facts() -> dict:
    """The device and versions a recording names: the CUDA device's name, torch, Triton, CUDA, the
    driver (from nvidia-smi) and the datasheet's peak bandwidth; without CUDA, the CPU under
    Triton's interpreter (no CUDA, driver or peak)."""
    import subprocess

    import torch
    import triton

    if not torch.cuda.is_available():
        return {
            "device": "CPU (Triton interpreter)",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": "none",
            "driver": "none",
            "peak_gbps": float("nan"),
        }
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


def cpu_facts() -> dict:
    """What a CPU recording names: the processor, torch's thread count, Python, torch and numpy
    versions, the commit (`commit_label`) and today's date."""
    import datetime
    import platform

    import numpy
    import torch

    return dict(
        device=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        python=platform.python_version(),
        torch=torch.__version__,
        numpy=numpy.__version__,
        commit=commit_label(),
        date=datetime.date.today().isoformat(),
    )


def commit_label() -> str:
    """The commit the code came from: $KVLIB_COMMIT (set where the checkout has no .git), else
    `git rev-parse --short HEAD` (with "+dirty" for uncommitted changes), else "unknown"."""
    import os
    import subprocess

    if os.environ.get("KVLIB_COMMIT"):
        return os.environ["KVLIB_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "kvlib"], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return (head.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def time_ms(fn) -> float:
    """Median milliseconds per call of `fn`: `triton.testing.do_bench` on a CUDA GPU (the L2
    cache cleared before each call), else a wall-clock median of 5 calls after one warm-up."""
    import time

    import torch

    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def graph_time_ms(fn, calls: int = GRAPH_CALLS) -> float | None:
    """GPU milliseconds per call of `fn`, by replaying a CUDA graph of `calls` calls (no host
    time); None without CUDA, or where `fn` cannot be captured."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        side = torch.cuda.Stream()  # warm up outside the graph, as torch.cuda.graphs asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        return None
    return time_ms(graph.replay) / calls


def copy_bandwidth_gbps(num_bytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes / time), by `time_ms`; on the
    CPU, a host memory copy of 64 MiB."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_bytes = num_bytes if device == "cuda" else 2**26
    source = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / (time_ms(lambda: target.copy_(source)) * 1e-3) / 1e9
