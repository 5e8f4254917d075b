"""`python -m kvlib.experiments.decode_bench`: the paged decode kernel (`kvlib.kernels`) against
SDPA over a contiguous cache, on a CUDA GPU, in GB/s against the measured copy bandwidth; writes
`results/decode_bench.csv` (chapter 11). `--dry-run` lists the cases and their cache sizes without a
GPU.

Two times per contender and case: `time_us` by `triton.testing.do_bench` (median of calls issued
one by one, the L2 cache cleared before each: it includes whatever host time a call costs beyond
the GPU's, which decides small shapes), and `graph_us`, the GPU time per call by replaying a CUDA
graph of `GRAPH_CALLS` calls (no host cost; the same inputs each call, so a cache smaller than the
L2 cache, 50-60 MB on an H100/H200, may be served partly from it). The copy bandwidth, the
practical limit both are compared with, is GPU time too.

Without CUDA, `tiny=True` (what chapter 11 runs on a CPU with `KVLIB_GPU_BRANCHES=cpu`) times a few
small cases of the kernel under Triton's interpreter with a wall-clock timer: it exercises the code
path and the CSV's shape, not a GPU's speed.
"""

from __future__ import annotations

import functools

import numpy as np

from kvlib.experiments import options
from kvlib.experiments.cli import write_rows
from kvlib.experiments.timing import copy_bandwidth_gbps, device_facts, graph_time_ms, time_ms

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


# The tiny cases (`tiny=True`): what the Triton interpreter finishes in seconds on a CPU.
TINY_HEADS, TINY_HEAD_DIM, TINY_BATCHES, TINY_CONTEXTS = [(4, 2)], 32, [1, 8], [64, 256]


def decode_cases(quick: bool = False, *, tiny: bool = False, bytes_per_element: int = 2) -> list:
    """Every (heads, batch, context, ragged) case of the benchmark, with its cache size in bytes
    of `bytes_per_element` (2: bf16/fp16). `quick`: 8 cases of 32/8 heads; `tiny`: 8 small cases
    for the CPU interpreter (D = 32)."""
    cases = []
    if tiny:
        heads, batches, contexts, head_dim = TINY_HEADS, TINY_BATCHES, TINY_CONTEXTS, TINY_HEAD_DIM
    elif quick:
        heads, batches, contexts, head_dim = DECODE_HEADS[:1], [1, 8], [4096, 32768], 128
    else:
        heads, batches, contexts, head_dim = DECODE_HEADS, DECODE_BATCHES, DECODE_CONTEXTS, 128
    for num_heads, num_kv_heads in heads:
        for batch in batches:
            for context in contexts:
                for ragged in (False, True):
                    lengths = decode_lengths(batch, context, ragged)
                    cases.append(
                        dict(
                            num_heads=num_heads,
                            num_kv_heads=num_kv_heads,
                            head_dim=head_dim,
                            batch=batch,
                            context=context,
                            ragged=ragged,
                            lengths=lengths,
                            cache_bytes=kv_bytes_read(
                                lengths, num_kv_heads, head_dim, bytes_per_element
                            ),
                        )
                    )
    return cases


def paged_decode_inputs(
    lengths, num_heads, num_kv_heads, head_dim, block_size, dtype=None, device="cuda"
):
    """Random inputs of one decode step on `device`, in `dtype` (default bfloat16): q (B, H, D);
    a paged cache (num_blocks, block_size, H_kv, D) twice (K, V) with shuffled block tables;
    seq_lens (B,) int32."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype

    from kvlib.cache.block_table import shuffled_block_tables

    generator = torch.Generator(device=device).manual_seed(0)
    block_tables, num_blocks = shuffled_block_tables(
        lengths, block_size, generator=generator, device=device
    )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    v_cache = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    q = torch.randn(
        len(lengths), num_heads, head_dim, dtype=dtype, device=device, generator=generator
    )
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
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
    out_csv: str,
    *,
    quick: bool = False,
    tiny: bool = False,
    memory_fraction: float = 0.35,
    dtype=None,
) -> list[dict]:
    """Time `paged_decode_attention` and SDPA on every case that fits; write and return the rows.

    Each case: block size 16, shuffled block tables, `dtype` (default `kernel_dtype()`: bf16, or
    fp16 on a GPU older than compute capability 8.0, fp32 in the CPU interpreter), D = 128 (32 with
    `tiny`). `time_us`: `time_ms` (do_bench's median on a GPU); `graph_us`: `graph_time_ms`, GPU
    time per call by graph replay (empty where not captured). GB/s: `kv_bytes_read` / time, the
    bytes of the sequences' own tokens for both contenders (`bytes_read`); `bytes_loaded` is
    what each loads: SDPA's contiguous cache of a ragged batch is padded to its longest sequence.

    Raises:
        ValueError: `tiny` on a CUDA machine, or neither `tiny` nor CUDA.
    """
    import datetime

    import torch
    from tqdm import tqdm

    from kvlib.kernels import paged_decode_attention
    from kvlib.ops.decode_plan import DecodeWorkspace, default_num_splits
    from kvlib.ops.devices import kernel_device, kernel_dtype

    device = kernel_device()
    if tiny == (device.type == "cuda"):
        raise ValueError(
            f"tiny: expected True exactly where the kernel runs on the CPU, got {tiny} on {device}"
        )
    dtype = kernel_dtype(device) if dtype is None else dtype
    element_bytes = torch.empty((), dtype=dtype).element_size()
    facts = device_facts()
    copy_gbps = copy_bandwidth_gbps()
    budget = (
        torch.cuda.get_device_properties(0).total_memory * memory_fraction
        if device.type == "cuda"
        else float("inf")
    )
    date = datetime.date.today().isoformat()
    rows = []
    cases = decode_cases(quick, tiny=tiny, bytes_per_element=element_bytes)
    for case in tqdm(cases, desc="decode cases", unit="case"):
        lengths, block_size = case["lengths"], 16
        if case["cache_bytes"] > budget:  # paged + contiguous copies must both fit
            continue
        shape = (case["num_heads"], case["num_kv_heads"], case["head_dim"])
        inputs = paged_decode_inputs(lengths, *shape, block_size, dtype, device)
        q = inputs[0]
        num_splits = default_num_splits(len(lengths), case["num_kv_heads"], max(lengths), device)
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
                device=device,
            ),
        )  # binds the tensors now, so the `del` below frees them once timed
        timings = {"triton_paged": (time_ms(paged), graph_time_ms(paged), f"splits={num_splits}")}
        k_dense = torch.randn(
            len(lengths),
            case["num_kv_heads"],
            max(lengths),
            case["head_dim"],
            dtype=dtype,
            device=device,
        )
        v_dense = torch.randn_like(k_dense)
        sdpa, backend = _sdpa_baseline(q, k_dense, v_dense, lengths)
        timings["sdpa_contiguous"] = (time_ms(sdpa), graph_time_ms(sdpa), backend)
        del k_dense, v_dense, inputs, paged, sdpa
        for kernel, (time_ms_, graph_ms, detail) in timings.items():
            gbps = case["cache_bytes"] / (time_ms_ * 1e-3) / 1e9
            graph_gbps = None if graph_ms is None else case["cache_bytes"] / (graph_ms * 1e-3) / 1e9
            padded = [max(lengths)] * len(lengths)
            rows.append(
                {
                    **facts,
                    "date": date,
                    "kernel": kernel,
                    "detail": detail,
                    "heads_q": case["num_heads"],
                    "heads_kv": case["num_kv_heads"],
                    "head_dim": case["head_dim"],
                    "dtype": str(dtype).removeprefix("torch."),
                    "block_size": block_size,
                    "batch": case["batch"],
                    "context": case["context"],
                    "ragged": case["ragged"],
                    "mean_len": round(float(np.mean(lengths)), 1),
                    "time_us": round(time_ms_ * 1e3, 2),
                    "bytes_read": case["cache_bytes"],
                    "bytes_loaded": (
                        case["cache_bytes"]
                        if kernel == "triton_paged"
                        else kv_bytes_read(
                            padded, case["num_kv_heads"], case["head_dim"], element_bytes
                        )
                    ),
                    "gbps": round(gbps, 1),
                    "pct_of_peak": round(100 * gbps / facts["peak_gbps"], 1),
                    "copy_gbps": round(copy_gbps, 1),
                    "pct_of_copy": round(100 * gbps / copy_gbps, 1),
                    "graph_us": "" if graph_ms is None else round(graph_ms * 1e3, 2),
                    "graph_gbps": "" if graph_gbps is None else round(graph_gbps, 1),
                    "graph_pct_of_copy": (
                        "" if graph_gbps is None else round(100 * graph_gbps / copy_gbps, 1)
                    ),
                }
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rows:  # after every case: a stopped run keeps what it measured
            write_rows(out_csv, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.experiments.decode_bench [--out CSV] [--quick] [--dry-run]`."""
    parser = options.parser(
        "python -m kvlib.experiments.decode_bench",
        "Paged decode attention vs SDPA on a GPU, GB/s against the copy bandwidth.",
        {
            "--out": {
                "default": "results/decode_bench.csv",
                "help": "CSV to write (default results/decode_bench.csv)",
            },
            "--quick": "a handful of shapes only",
            "--tiny": "without CUDA: a few small cases under the Triton interpreter (checks the "
            "code path)",
            "--dry-run": "list the cases and their cache sizes; time nothing (no GPU needed)",
        },
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        for case in decode_cases(args.quick, tiny=args.tiny):
            print(
                f"H={case['num_heads']:>2} H_kv={case['num_kv_heads']:>2} "
                f"batch={case['batch']:>2} context={case['context']:>6} "
                f"{'ragged' if case['ragged'] else 'uniform':<7} K+V bytes={case['cache_bytes']:,}"
            )
        return 0
    options.need_cuda(
        parser,
        "decode needs a CUDA GPU (try --dry-run to list the cases, or --tiny)",
        unless=args.tiny,
    )
    import pathlib

    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = decode_benchmark(args.out, quick=args.quick, tiny=args.tiny)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
