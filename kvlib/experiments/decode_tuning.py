"""`python -m kvlib.experiments.decode_tuning`: the decode kernel's launch sweep (split count x
`BLOCK_N` x `num_warps` x `num_stages` on a few shapes, a CUDA GPU), written to
`results/decode_tuning.csv`, whose conclusions are frozen in `kvlib.ops.decode_plan.GPU_LAUNCH` and
`kvlib.ops.launch`; `--ab --base REV` times the kernel of a base commit (checked out in a detached
git worktree) against the working tree's in one process.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np

from kvlib.experiments import options
from kvlib.experiments.cli import write_rows
from kvlib.experiments.decode_bench import kv_bytes_read, paged_decode_inputs
from kvlib.experiments.timing import commit_label, copy_bandwidth_gbps, device_facts

TUNE_SHAPES = [  # (batch, H, H_kv, context): few, many and very many (sequence, KV head) pairs
    (batch, num_heads, num_kv_heads, context)
    for batch, num_heads, num_kv_heads in [(1, 32, 8), (1, 32, 32), (8, 32, 8), (64, 32, 8)]
    for context in (4096, 32768, 131072)
]


def tune_decode(out_csv: str) -> list[dict]:
    """Time `paged_decode_attention` over split count x BLOCK_N x num_warps x num_stages on each
    `TUNE_SHAPES` case (bf16, D = 128, block size 16); write every timing to `out_csv`.

    The sweep is recorded, not applied at run time: `kvlib.ops.decode_plan.default_num_splits` and
    the kernel's defaults freeze what it found, so CPU runs stay deterministic.
    """
    import datetime
    import functools
    import itertools

    import torch
    from tqdm import tqdm
    from triton.testing import do_bench

    from kvlib.kernels import paged_decode_attention
    from kvlib.ops.decode_plan import DecodeWorkspace

    facts = {**device_facts(), "date": datetime.date.today().isoformat()}
    copy_gbps = copy_bandwidth_gbps()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = list(itertools.product([1, 2, 4, 8, 16, 32, 64, 128], [32, 64, 128], [4, 8], [2, 3]))
    rows = []
    for batch, num_heads, num_kv_heads, context in tqdm(TUNE_SHAPES, desc="tune", unit="shape"):
        lengths = [context] * batch
        inputs = paged_decode_inputs(lengths, num_heads, num_kv_heads, 128, 16)
        cache_bytes = kv_bytes_read(lengths, num_kv_heads, 128, 2)
        out = torch.empty_like(inputs[0])
        workspace = DecodeWorkspace.allocate(batch, num_heads, 128, device="cuda")  # 128 splits
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
    return write_rows(out_csv, rows)


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
    import tempfile

    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    import kvlib.kernels as head
    from kvlib.ops.decode_plan import default_num_splits
    from kvlib.testing import assert_close

    facts = {**device_facts(), "date": datetime.date.today().isoformat()}
    head_label = commit_label()
    copy_gbps = copy_bandwidth_gbps()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        old = load_kernels_at(base, workdir)
        try:
            for batch, num_heads, num_kv_heads, context in AB_SHAPES:
                lengths = [context] * batch
                inputs = paged_decode_inputs(lengths, num_heads, num_kv_heads, 128, 16)
                num_splits = default_num_splits(batch, num_kv_heads, context, "cuda")
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
    return write_rows(out_csv, rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.experiments.decode_tuning [--out CSV]`: the launch sweep;
    `--ab [--base REV] [--out CSV]`: the kernel at a base commit against the working tree's."""
    parser = options.parser(
        "python -m kvlib.experiments.decode_tuning",
        "Sweep the decode kernel's launch options on a few shapes (a CUDA GPU).",
        {
            "--out": {
                "help": "CSV to write (default results/decode_tuning.csv; --ab: decode_ab.csv)"
            },
            "--ab": "A/B the kernel against --base",
            "--base": {"default": "e40ecea", "help": "git revision to compare against"},
        },
    )
    args = parser.parse_args(argv)
    options.need_cuda(parser, "the tuning sweep and --ab need a CUDA GPU")
    if args.ab:
        out = args.out or "decode_ab.csv"
        rows = ab_decode(out, args.base)
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
        print(f"wrote {len(rows)} rows to {out}")
        return 0
    import pathlib

    out = args.out or "results/decode_tuning.csv"
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {len(tune_decode(out))} rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
