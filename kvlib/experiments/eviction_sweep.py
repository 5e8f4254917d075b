"""`python -m kvlib.experiments.eviction_sweep`: chapter 8's eviction policies at several budgets,
on the course model's recall, SmolLM2's passkey retrieval and its agreement with the full cache on
an essay (CPU, 2 threads, about 15 minutes); writes `results/eviction_sweep.csv`.
"""

from __future__ import annotations

from kvlib.experiments.cli import run
from kvlib.experiments.sweep import run_sweep


def _policies(snapkv_window: int) -> dict:
    """The sweep's policies, by label: fresh instances (a policy may hold state such as a seed)."""
    from kvlib.cache import eviction_policies as ev

    return {
        "StreamingLLM": lambda: (ev.StreamingLLM(4), "original"),
        "StreamingLLM, cache positions": lambda: (ev.StreamingLLM(4), "cache"),
        "window only": lambda: (ev.StreamingLLM(0), "original"),
        "H2O": lambda: (ev.H2O(), "original"),
        "H2O, normalized": lambda: (ev.H2O(normalize=True), "original"),
        "TOVA": lambda: (ev.TOVA(), "original"),
        "SnapKV": lambda: (ev.SnapKV(snapkv_window, 7), "original"),
        "random": lambda: (ev.RandomEviction(0), "original"),
    }


EVICTION_RECALL_BUDGETS = (32, 64, 128)  # of the course model's 256-token documents
EVICTION_PASSKEY_BUDGETS = (64, 128, 256)  # of SmolLM2's 613-token passkey prompts
EVICTION_TEXT_BUDGETS = (48, 64, 128, 256)  # of the 440-token essay (SnapKV needs > 32)


def eviction_factory(label: str, budget: int | None, *, snapkv_window: int = 32):
    """The `cache=` factory for sweep policy `label` (see `_policies`) at `budget` (None or
    "full": no eviction)."""
    from kvlib.cache.evicting import EvictingCache
    from kvlib.cache.eviction_policies import StreamingLLM

    if label == "full" or budget is None:
        return EvictingCache.factory(StreamingLLM(), None)
    policy, positions = _policies(snapkv_window)[label]()
    return EvictingCache.factory(policy, budget, positions=positions)


def eviction_sweep(out_csv: str, *, seed: int = 0) -> list[dict]:
    """Chapter 8's sweep (about 13 minutes on a 2-core laptop CPU): every policy at every budget, on

    - the course model's recall by distance (`recall_by_distance`, 32 documents per distance,
      streamed one token at a time; SnapKV's window is 8 here, since 32 would fill the smallest
      budget);
    - SmolLM2's passkey retrieval (filler `EVICTION_PASSKEY_FILLER`, five depths, one seeded key
      per depth, prefill in chunks of `EVICTION_CHUNK`);
    - SmolLM2 on the course essay: perplexity, agreement and KL with the full cache.

    Writes one row per measurement to `out_csv` (the committed `results/eviction_sweep.csv`,
    which a test spot-checks)."""
    labels = list(_policies(32))
    jobs = [("recall", "full", None)] + [
        ("recall", label, b) for b in EVICTION_RECALL_BUDGETS for label in labels
    ]
    jobs += [("passkey", "full", None)] + [
        ("passkey", label, b)
        for b in EVICTION_PASSKEY_BUDGETS
        for label in labels
        if label not in ("StreamingLLM, cache positions", "H2O, normalized")
    ]
    jobs += [("text", label, b) for b in EVICTION_TEXT_BUDGETS for label in labels]

    def factory(task, label, budget):
        return eviction_factory(label, budget, snapkv_window=8 if task == "recall" else 32)

    return run_sweep(out_csv, jobs, "eviction sweep", factory, seed)


def main(argv: list[str] | None = None) -> int:
    return run("eviction_sweep", __doc__, "results/eviction_sweep.csv", eviction_sweep, argv)


if __name__ == "__main__":
    raise SystemExit(main())
