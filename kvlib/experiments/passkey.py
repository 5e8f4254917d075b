"""`python -m kvlib.experiments.passkey`: passkey retrieval by SmolLM2-135M-Instruct with the full
cache, over lengths and depths (CPU, about 3 minutes); writes `results/passkey_smollm2.csv`.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib.experiments.cli import run, write_rows
from kvlib.metrics.passkey import passkey_trial

PASSKEY_LENGTHS = (200, 320, 560, 1040)
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def passkey_sweep(out_csv: str, *, seed: int = 0) -> list[dict]:
    """Passkey retrieval of SmolLM2-135M-Instruct over `PASSKEY_LENGTHS` x `PASSKEY_DEPTHS`, one
    seeded key per cell; writes every trial to `out_csv` (the committed
    `results/passkey_smollm2.csv`, which a test spot-checks)."""
    import datetime

    from tqdm import tqdm

    from kvlib.loaders.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    rng = np.random.default_rng(seed)
    rows = []
    cells = [(n, d) for n in PASSKEY_LENGTHS for d in PASSKEY_DEPTHS]
    for filler_tokens, depth in tqdm(cells, desc="passkey trials", unit="trial"):
        passkey = int(rng.integers(10_000, 100_000))
        correct, prompt_tokens = passkey_trial(model, tokenizer, filler_tokens, depth, passkey)
        rows.append(
            {
                "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
                "filler_tokens": filler_tokens,
                "depth": depth,
                "passkey": passkey,
                "prompt_tokens": prompt_tokens,
                "correct": correct,
                "torch": torch.__version__,
                "date": datetime.date.today().isoformat(),
            }
        )
    return write_rows(out_csv, rows)


def main(argv: list[str] | None = None) -> int:
    def record(out: str) -> str:
        rows = passkey_sweep(out)
        return f"wrote {len(rows)} trials to {out}: {sum(r['correct'] for r in rows)} correct"

    return run(
        "passkey",
        "Passkey retrieval by SmolLM2-135M-Instruct (CPU).",
        "results/passkey_smollm2.csv",
        record,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
