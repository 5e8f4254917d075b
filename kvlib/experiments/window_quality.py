"""`python -m kvlib.experiments.window_quality`: SmolLM2 under a sliding window it was never trained
for, with and without sink tokens; writes `results/window_quality.csv` (chapter 17's Measure).

SmolLM2-135M-Instruct was trained with full attention. Here it reads the course essay
(`kvlib.metrics.quality.course_text`, its own tokenizer) in one forward per setting, each query
seeing exactly the keys a mask allows: the last `window` positions, itself included (a query at
p sees p - W < j <= p, as `kvlib.ops.attention.visible` counts them), plus, with `sinks` > 0, the
first `sinks` positions of the text (StreamingLLM's attention sinks, Xiao et al., ICLR 2024). The
mask goes in as the model's `tree_mask` (a (T, T) bool mask over the new tokens, within the causal
rule), so nothing is cached or evicted: the result is the window's, not a cache policy's.

Per setting and position it compares the next-token distribution with full attention's: the KL
divergence (nats), the negative log-likelihood of the essay's next token, and whether the top-1
token agrees; one row per (window, sinks) with their means, the perplexity, and a paired
moving-block bootstrap interval (blocks of 32 positions: positions of one text are not
independent) for the mean KL and, for sinks > 0, for the KL saved against no sinks at the same
window; `full_perplexity`, on every row, is full attention's own on the same text (the reference
the windows are measured against). `--quick`: one window, for the spot check.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib.experiments import options
from kvlib.experiments.cli import write_rows

WINDOWS = (32, 64, 128, 256)
SINKS = (0, 4)
BLOCK = 32  # positions per bootstrap block

PROVENANCE_SOURCES = (
    "kvlib/experiments/window_quality.py",
    "kvlib/layers/llama.py",
    "kvlib/loaders/gguf.py",
    "kvlib/loaders/smollm2.py",
    "kvlib/metrics/bootstrap.py",
    "kvlib/metrics/quality.py",
    "kvlib/model.py",
    "kvlib/ops/attention.py",
    "kvlib/texts/kv_cache_essay.txt",
)


def window_mask(num_tokens: int, window: int, sinks: int = 0) -> torch.Tensor:
    """(T, T) bool: query i sees key j when j <= i and (j > i - window or j < sinks)."""
    j, i = torch.arange(num_tokens)[None, :], torch.arange(num_tokens)[:, None]
    return (j <= i) & ((j > i - window) | (j < sinks))


def per_position(model, ids: torch.Tensor, windows=WINDOWS, sinks=SINKS) -> dict:
    """{(window, sinks): (kl, nll, agree)} per predicted position (T - 1 each), against the full
    forward's distributions, and {"full": nll} for full attention itself; ids (1, T)."""
    num_tokens = ids.shape[1]
    with torch.no_grad():
        full = model(ids)[0, :-1].log_softmax(-1)  # (T - 1, V)
        out = {"full": -full.gather(-1, ids[0, 1:, None])[:, 0].double().numpy()}
        for window in windows:
            for s in sinks:
                mask = window_mask(num_tokens, window, s)
                logp = model(ids, tree_mask=mask)[0, :-1].log_softmax(-1)
                kl = (full.exp() * (full - logp)).sum(-1)
                nll = -logp.gather(-1, ids[0, 1:, None])[:, 0]
                agree = (logp.argmax(-1) == full.argmax(-1)).float()
                out[window, s] = tuple(x.double().numpy() for x in (kl, nll, agree))
    return out


def measure(quick: bool = False) -> list[dict]:
    from kvlib.loaders.smollm2 import load_smollm2
    from kvlib.metrics.bootstrap import paired_block_bootstrap
    from kvlib.metrics.quality import course_text

    model, tokenizer = load_smollm2()
    ids = torch.tensor([tokenizer.encode(course_text())])
    windows = WINDOWS[-1:] if quick else WINDOWS
    values = per_position(model, ids, windows)
    full_perplexity = round(float(np.exp(values.pop("full").mean())), 3)  # the reference's
    rows = []
    for (window, s), (kl, nll, agree) in values.items():
        _, low, high = paired_block_bootstrap(kl, block=BLOCK)
        saved = (np.nan, np.nan, np.nan)
        if s:
            saved = paired_block_bootstrap(values[window, 0][0], kl, block=BLOCK)
        rows.append(
            dict(
                model="SmolLM2-135M-Instruct",
                text="kv_cache_essay",
                positions=len(kl),
                window=window,
                sinks=s,
                mean_kl=round(float(kl.mean()), 5),
                kl_low=round(low, 5),
                kl_high=round(high, 5),
                perplexity=round(float(np.exp(nll.mean())), 3),
                full_perplexity=full_perplexity,
                top1_agreement=round(float(agree.mean()), 5),
                kl_saved_by_sinks=round(saved[0], 5),
                saved_low=round(saved[1], 5),
                saved_high=round(saved[2], 5),
            )
        )
    return rows


def record(out_csv: str, quick: bool = False) -> list[dict]:
    from kvlib.experiments.timing import cpu_facts

    facts = cpu_facts()
    return write_rows(out_csv, [{**row, **facts} for row in measure(quick)])


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(
        "python -m kvlib.experiments.window_quality",
        __doc__,
        {
            "--out": {"default": "results/window_quality.csv", "help": "CSV to write"},
            "--quick": "the largest window only, with and without sinks",
        },
    )
    args = parser.parse_args(argv)
    rows = record(args.out, quick=args.quick)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
