"""`python -m kvlib.experiments.smollm2_steps`: SmolLM2-135M-Instruct's generation step with and
without the KV cache on a CUDA GPU, in bf16, at prefix lengths up to its 8,192-token context;
writes `results/smollm2_steps_gpu.csv` (chapter 2 plots it beside its CPU measurement).

At prefix length n: `uncached` is one forward pass over all n tokens (what a step costs without a
cache); `cached` is one decode step of one token after n - 1 cached tokens (a `StaticCache`,
rewound before each run so every run writes the same slot). Each time is the median of `repeats`
runs timed with CUDA events, after warm-up runs; the contenders alternate run by run.
"""

from __future__ import annotations

import numpy as np

from kvlib.experiments.cli import write_rows

LENGTHS = (16, 64, 256, 1024, 4096, 8192)


def step_times_ms(model, lengths=LENGTHS, *, repeats: int = 20, warmup: int = 3) -> list[dict]:
    """Median uncached and cached step times (ms) at each prefix length, on the model's device."""
    import torch

    from kvlib.cache import StaticCache

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(256, model.config.vocab_size, (1, max(lengths)), generator=generator)
    ids = ids.to(model.lm_head.weight.device)
    cache = StaticCache.for_model(model, 1, max(lengths))
    rows = []
    with torch.no_grad():
        for n in lengths:
            cache.length = 0
            model(ids[:, : n - 1], cache=cache, validate=False)

            def cached(n=n):
                cache.length = n - 1
                model(ids[:, n - 1 : n], cache=cache, validate=False)

            contenders = {
                "uncached": lambda n=n: model(ids[:, :n], validate=False),
                "cached": cached,
            }
            times = {name: [] for name in contenders}
            for run in range(warmup + repeats):
                for name, fn in contenders.items():
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    if run >= warmup:
                        times[name].append(start.elapsed_time(end))
            rows.append({"prefix_len": n, **{k: float(np.median(v)) for k, v in times.items()}})
    return rows


def record(out_csv: str) -> str:
    import datetime

    import torch

    from kvlib.experiments.timing import commit_label, device_facts
    from kvlib.loaders.smollm2 import load_smollm2

    if not torch.cuda.is_available():
        raise SystemExit("smollm2_steps measures on a CUDA GPU")
    model, _ = load_smollm2(dtype=torch.bfloat16, device="cuda")
    facts = {
        **device_facts(),
        "commit": commit_label(),
        "date": datetime.date.today().isoformat(),
        "dtype": "bfloat16",
    }
    rows = [
        {
            **facts,
            "prefix_len": row["prefix_len"],
            "uncached_ms": round(row["uncached"], 3),
            "cached_ms": round(row["cached"], 3),
        }
        for row in step_times_ms(model)
    ]
    write_rows(out_csv, rows)
    return f"wrote {len(rows)} rows to {out_csv}"


def main(argv: list[str] | None = None) -> int:
    from kvlib.experiments.cli import run

    return run(
        "smollm2_steps",
        "SmolLM2's cached and uncached generation step on a CUDA GPU.",
        "results/smollm2_steps_gpu.csv",
        record,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
