"""`python -m kvlib.experiments.quant_sweep`: chapter 10's quantized caches (int8, fp8, int4, int2,
per token or KIVI's per-channel keys with a full-precision residual) on the same tasks as the
eviction sweep (CPU, 2 threads, about 12 minutes); writes `results/quant_sweep.csv`.
"""

from __future__ import annotations

from kvlib.experiments.cli import run
from kvlib.experiments.sweep import run_sweep

KIVI_GROUP = 32  # G: KIVI's group size (Liu et al., 2024), tokens per key scale, channels per value
KIVI_RESIDUAL = 128  # R: KIVI's residual length in its experiments
QUANT_RESIDUALS = (0, 16, 32, 64, KIVI_RESIDUAL)  # the R sweep, for 2-bit KIVI


def quant_schemes() -> dict:
    """Chapter 10's schemes, by label: (key scheme, value scheme) for `QuantizedCache`."""
    from kvlib.quant import QuantScheme as Q

    g = KIVI_GROUP

    def per_token(fmt, symmetric=True):
        return Q(fmt, symmetric, "channels")

    return {
        "int8 per-token": (per_token("int8"), per_token("int8")),
        "fp8 e4m3 per-token": (per_token("fp8_e4m3fn"), per_token("fp8_e4m3fn")),
        "fp8 e5m2 per-token": (per_token("fp8_e5m2"), per_token("fp8_e5m2")),
        "int4 per-token": (per_token("int4", False), per_token("int4", False)),
        "int4 KIVI": (Q("int4", False, "tokens", g), Q("int4", False, "channels", g)),
        "int2 per-token": (per_token("int2", False), per_token("int2", False)),
        "int2 KIVI": (Q("int2", False, "tokens", g), Q("int2", False, "channels", g)),
    }


def quant_factory(label: str, residual_length: int = 0):
    """The `cache=` factory for chapter 10's scheme `label` (see `quant_schemes`; "full": the
    dynamic cache) with a full-precision residual of `residual_length` tokens."""
    from kvlib.cache.quantized import QuantizedCache

    if label == "full":
        return "dynamic"
    key, value = quant_schemes()[label]
    return QuantizedCache.factory(key, value, residual_length=residual_length)


def quant_sweep(out_csv: str, *, seed: int = 0) -> list[dict]:
    """Chapter 10's sweep (about 12 minutes on a 2-core laptop CPU): every scheme of
    `quant_schemes` with no residual, and 2-bit KIVI at every residual length of
    `QUANT_RESIDUALS`, on the course model's recall by distance (32 documents per distance,
    streamed a token at a time), SmolLM2's passkey (as chapter 8's sweep) and SmolLM2 on the
    course essay (perplexity, agreement and KL with the full cache). Rows as `eviction_sweep`'s,
    `policy` holding the scheme and `budget` the residual length; written to `out_csv` (the
    committed `results/quant_sweep.csv`, which a test spot-checks)."""
    runs = [("full", 0)] + [(label, 0) for label in quant_schemes()]
    runs += [("int2 KIVI", r) for r in QUANT_RESIDUALS if r]
    jobs = [(task, label, r) for label, r in runs for task in ("recall", "text", "passkey")]
    return run_sweep(
        out_csv, jobs, "quantization sweep", lambda task, label, r: quant_factory(label, r), seed
    )


def main(argv: list[str] | None = None) -> int:
    return run("quant_sweep", __doc__, "results/quant_sweep.csv", quant_sweep, argv)


if __name__ == "__main__":
    raise SystemExit(main())
