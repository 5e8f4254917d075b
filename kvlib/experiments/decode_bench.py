"""`python -m kvlib.experiments.decode_bench`: the paged decode kernel (`kvlib.kernels`) against
SDPA over a contiguous cache, on a CUDA GPU, in GB/s against the measured copy bandwidth; writes
`results/decode_bench.csv` (chapter 11). Timed with `triton.testing.do_bench`; `--dry-run` lists
the cases and their cache sizes without a GPU.
"""

from __future__ import annotations

import functools

import numpy as np

from kvlib.experiments.cli import write_rows

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


def device_facts() -> dict:
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


def copy_bandwidth_gbps(num_bytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes / time), by do_bench."""
    import torch
    from triton.testing import do_bench

    source = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    time_ms = do_bench(lambda: target.copy_(source), warmup=10, rep=100, return_mode="median")
    return 2 * num_bytes / (time_ms * 1e-3) / 1e9


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

    import torch
    from tqdm import tqdm
    from triton.testing import do_bench

    from kvlib.kernels import paged_decode_attention
    from kvlib.ops.decode_plan import DecodeWorkspace, default_num_splits

    facts = device_facts()
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
    return write_rows(out_csv, rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.experiments.decode_bench [--out CSV] [--quick] [--dry-run]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvlib.experiments.decode_bench",
        description="Paged decode attention vs SDPA on a GPU, GB/s against the copy bandwidth.",
    )
    parser.add_argument(
        "--out",
        default="results/decode_bench.csv",
        help="CSV to write (default results/decode_bench.csv)",
    )
    parser.add_argument("--quick", action="store_true", help="a handful of shapes only")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the cases and their cache sizes; time nothing (no GPU needed)",
    )
    args = parser.parse_args(argv)
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
