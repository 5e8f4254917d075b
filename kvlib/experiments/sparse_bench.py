"""`python -m kvlib.experiments.sparse_bench`: a decode step of chapter 15's sparse attention on a
CUDA GPU, against dense: chapter 11's kernel over a compacted block table of `k` of a sequence's
`P` pages, plus the selection that builds it (Quest's page scores, top-k, compaction), timed at
fractions `k / P` from 1/64 to 1 and contexts of 32k to 128k tokens; writes
`results/sparse_bench.csv` with the device, versions, date and commit (chapter 15).

Each case is Llama 3 8B's attention shape (32 query heads over 8 KV heads, D = 128), bfloat16,
pages of 16 tokens in shuffled blocks, the bounds pools beside them. Times are
`triton.testing.do_bench` medians (it clears the L2 cache before each run): `dense` (the kernel
over the full table), `select` (bounds to compacted table), `attend` (the kernel over the
compacted table) and `sparse` (both, one call after the other); each case's sparse output is first
checked against `paged_decode_attention_ref` over the same table. Bytes read: `dense_bytes`, the
K/V of every token; `sparse_bytes`, the selected pages' K/V plus every page's bounds
(`kvlib.memory.sparse`'s equation, one layer).

Timers and device facts are the GPU recordings' (`kvlib.experiments.timing`): `*_us` the median
per call, `*_graph_us` the GPU time per call by CUDA-graph replay (empty where not captured).

`--tiny` runs a few small float32 cases on whatever device the kernel runs on (Triton's interpreter
on a CPU, timed by the wall clock): the code path of the benchmark, checked in CI, and the
measurement chapter 15 shows where no GPU result is recorded; its times are the interpreter's,
which runs the kernel's programs one by one in Python, not a GPU's.
"""

from __future__ import annotations

import math

SPARSE_BENCH_CONTEXTS = (32768, 65536, 131072)
SPARSE_BENCH_BATCHES = (1, 8)
SPARSE_BENCH_FRACTIONS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
SPARSE_BENCH_HEADS = (32, 8, 128)  # (H, H_kv, D): Llama 3 8B
TINY_CASES = dict(contexts=(512,), batches=(1,), fractions=(1 / 8, 1 / 2, 1.0))
QUICK_CASES = dict(contexts=(32768, 131072), batches=(1,), fractions=(1 / 64, 1 / 16, 1 / 4, 1.0))
TINY_HEADS = (2, 1, 16)  # the interpreter's time grows with the programs: one KV head
BLOCK_SIZE = 16
# what `python -m kvlib.course.recorded stamp results/sparse_bench.csv` hashes (a source that
# changes labels the recorded figure in chapter 15)
PROVENANCE_SOURCES = (
    "kvlib/cache/block_table.py",
    "kvlib/experiments/cli.py",
    "kvlib/experiments/options.py",
    "kvlib/experiments/sparse_bench.py",
    "kvlib/experiments/timing.py",
    "kvlib/kernels.py",
    "kvlib/ops/decode_checks.py",
    "kvlib/ops/decode_plan.py",
    "kvlib/ops/devices.py",
    "kvlib/ops/interpreter.py",
    "kvlib/ops/launch.py",
    "kvlib/ops/triton_decode.py",
    "kvlib/sparse/bounds.py",
    "kvlib/sparse/selection.py",
)


def bench_cases(tiny: bool = False, quick: bool = False) -> list[dict]:
    """Every (batch, context, fraction) case, with its pages and budget (>= 2: the sink and the
    newest page are always read); `quick`: batch 1 at 32k and 128k, four fractions (a notebook's
    live run); `tiny`: one small context for the interpreter."""
    full = dict(
        contexts=SPARSE_BENCH_CONTEXTS,
        batches=SPARSE_BENCH_BATCHES,
        fractions=SPARSE_BENCH_FRACTIONS,
    )
    grid = TINY_CASES if tiny else QUICK_CASES if quick else full
    cases = []
    for batch in grid["batches"]:
        for context in grid["contexts"]:
            pages = math.ceil(context / BLOCK_SIZE)
            for fraction in grid["fractions"]:
                budget = max(2, round(fraction * pages))
                cases.append(dict(batch=batch, context=context, pages=pages, budget=budget))
    return cases


def bench_inputs(batch, context, heads, dtype, device, seed=0) -> dict:
    """One decode step's inputs: q (B, H, D); K/V pools (num_blocks, 16, H_kv, D) in shuffled
    blocks; block tables (B, P) int32; seq_lens (B,) int32; the pools' page bounds
    (num_blocks, H_kv, D), as `kvlib.cache.paged_bounds` keeps them."""
    import torch

    from kvlib.cache.block_table import shuffled_block_tables

    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator(device=device).manual_seed(seed)
    lengths = [context] * batch
    tables, num_blocks = shuffled_block_tables(
        lengths, BLOCK_SIZE, generator=generator, device=device
    )
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    keys = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    return dict(
        q=torch.randn(batch, num_heads, head_dim, generator=generator, device=device, dtype=dtype),
        k_cache=keys,
        v_cache=torch.randn(shape, generator=generator, device=device, dtype=dtype),
        block_tables=tables,
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        key_min=keys.amin(dim=1),  # (num_blocks, H_kv, D): every block is full here
        key_max=keys.amax(dim=1),
    )


def select_step(inputs: dict, budget: int):
    """Quest's selection for one decode step: page scores, top-k with the sink and newest pages,
    the compacted tables and lengths (`kvlib.sparse`)."""
    from kvlib.sparse.bounds import quest_page_scores
    from kvlib.sparse.selection import compact_block_tables, select_pages

    tables, lens = inputs["block_tables"], inputs["seq_lens"]
    scores = quest_page_scores(inputs["q"], inputs["key_min"], inputs["key_max"], tables)
    num_pages = (lens.long() + BLOCK_SIZE - 1) // BLOCK_SIZE
    selected = select_pages(scores, num_pages, budget)
    return compact_block_tables(tables, lens, selected, BLOCK_SIZE, budget, validate=False)


def bytes_read(case: dict, heads, element_bytes: int) -> tuple[int, int]:
    """(dense, sparse) bytes one layer's decode step reads: every token's K/V; the selected
    pages' K/V and every page's bounds (2 · D per KV head, one token's K and V)."""
    _, num_kv_heads, head_dim = heads
    per_token = 2 * num_kv_heads * head_dim * element_bytes  # K and V
    batch, context, pages, budget = case["batch"], case["context"], case["pages"], case["budget"]
    if budget >= pages:
        return batch * context * per_token, batch * context * per_token
    fill = context - (pages - 1) * BLOCK_SIZE
    sparse_tokens = (budget - 1) * BLOCK_SIZE + fill + pages
    return batch * context * per_token, batch * sparse_tokens * per_token


def sparse_bench(out_csv: str | None, *, tiny: bool = False, quick: bool = False) -> list[dict]:
    """Time dense and sparse decode steps on every case of `bench_cases(tiny, quick)` on the
    kernel's device (`tiny`: float32, small heads); write the rows to `out_csv` (None: only
    return them). Raises TritonUnavailableError without Triton."""
    import datetime

    import torch

    from kvlib.experiments.cli import write_rows
    from kvlib.experiments.timing import commit_label, device_facts, graph_time_ms, time_ms
    from kvlib.kernels import paged_decode_attention, paged_decode_attention_ref
    from kvlib.ops.decode_plan import default_num_splits
    from kvlib.ops.devices import kernel_device, kernel_dtype

    device = kernel_device()
    dtype = torch.float32 if tiny else kernel_dtype(device)  # bf16 (fp16 before Ampere) on a GPU
    heads = TINY_HEADS if tiny else SPARSE_BENCH_HEADS
    date, commit = datetime.date.today().isoformat(), commit_label()
    facts = {**device_facts(), "date": date, "commit": commit}
    rows, inputs = [], None
    for case in bench_cases(tiny, quick):
        key = (case["batch"], case["context"])
        if inputs is None or inputs["key"] != key:
            inputs = dict(bench_inputs(*key, heads, dtype, device), key=key)
        q, k, v = inputs["q"], inputs["k_cache"], inputs["v_cache"]
        tables, lens = inputs["block_tables"], inputs["seq_lens"]
        dense_splits = default_num_splits(case["batch"], heads[1], case["context"], device)
        compact, compact_lens = select_step(inputs, case["budget"])
        longest = int(compact_lens.max())
        splits = default_num_splits(case["batch"], heads[1], longest, device)

        def dense():  # the hot path: no validation (a host sync), as an engine calls it
            return paged_decode_attention(
                q, k, v, tables, lens, num_splits=dense_splits, validate=False
            )

        def attend():
            return paged_decode_attention(
                q, k, v, compact, compact_lens, num_splits=splits, validate=False
            )

        def sparse():
            chosen, chosen_lens = select_step(inputs, case["budget"])
            return paged_decode_attention(
                q, k, v, chosen, chosen_lens, num_splits=splits, validate=False
            )

        expected = paged_decode_attention_ref(q, k, v, compact, compact_lens)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # validated once, checked
        got = paged_decode_attention(q, k, v, compact, compact_lens, num_splits=splits)
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)

        calls = {
            "dense": dense,
            "select": lambda: select_step(inputs, case["budget"]),
            "attend": attend,
            "sparse": sparse,
        }
        times = {name: time_ms(fn) for name, fn in calls.items()}
        graphs = {name: graph_time_ms(fn) for name, fn in calls.items() if name != "select"}
        dense_bytes, sparse_bytes = bytes_read(case, heads, dtype.itemsize)
        rows.append(
            {
                **facts,
                "dtype": str(dtype).removeprefix("torch."),
                "heads_q": heads[0],
                "heads_kv": heads[1],
                "head_dim": heads[2],
                "block_size": BLOCK_SIZE,
                **case,
                "fraction": round(case["budget"] / case["pages"], 6),
                "compact_tokens": longest,
                **{f"{name}_us": round(ms * 1e3, 2) for name, ms in times.items()},
                **{
                    f"{name}_graph_us": "" if ms is None else round(ms * 1e3, 2)
                    for name, ms in graphs.items()
                },
                "dense_bytes": dense_bytes,
                "sparse_bytes": sparse_bytes,
            }
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows if out_csv is None else write_rows(out_csv, rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.experiments.sparse_bench [--out CSV] [--tiny | --quick]`."""
    from kvlib.experiments import options

    parser = options.parser(
        "python -m kvlib.experiments.sparse_bench",
        "Sparse (Quest) vs dense decode attention through chapter 11's kernel.",
        {
            "--out": {
                "default": "results/sparse_bench.csv",
                "help": "CSV to write (default: %(default)s)",
            },
            "--tiny": "small float32 cases (the interpreter on a CPU)",
            "--quick": "batch 1, 32k and 128k, 4 fractions",
        },
    )
    args = parser.parse_args(argv)
    options.need_cuda(
        parser,
        "the benchmark needs a CUDA GPU (--tiny runs small cases on the CPU)",
        unless=args.tiny,
    )
    rows = sparse_bench(args.out, tiny=args.tiny, quick=args.quick)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
