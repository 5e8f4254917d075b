"""`python -m kvlib.experiments.quant_flush_unit`: the control behind chapter 10's comparison of
per-token int4 with KIVI's int4 at no residual (R = 0); writes `results/quant_flush_unit.csv`
(CPU, a few minutes: two streams of the essay).

At R = 0 the two schemes differ in more than the axis of the keys' scales. KIVI's keys (per
channel, over groups of G = 32 tokens) leave `QuantizedCache`'s residual only in whole groups, so
its newest 0 to 31 keys are always exact; per-token keys are quantized as they arrive and none is.
`KeyFlushUnitCache` holds per-token keys back the same way (flushed in units of G tokens), and this
experiment streams SmolLM2 over the course essay through it (perplexity, top-1 agreement and KL
against the full cache, as `kvlib.experiments.quant_sweep`'s text rows):

- "int4 per-token, keys flushed per 32": "int4 per-token" with that one change;
- "int4 per-token keys flushed per 32, KIVI's values": the keys as above, the values KIVI's (per
  token, in groups of 32 channels), so that only the keys' scale axis differs from "int4 KIVI".

Rows as `kvlib.experiments.sweep.run_sweep` writes them (`budget`: R = 0).
"""

from __future__ import annotations

from kvlib._validate import check_positive_int
from kvlib.cache.quantized import QuantizedCache
from kvlib.experiments.cli import run
from kvlib.experiments.quant_sweep import KIVI_GROUP, quant_schemes
from kvlib.experiments.sweep import run_sweep

__all__ = ["FLUSH_UNIT_LABELS", "KeyFlushUnitCache", "flush_unit_factory", "quant_flush_unit"]

FLUSH_UNIT_LABELS = (
    "int4 per-token, keys flushed per 32",
    "int4 per-token keys flushed per 32, KIVI's values",
)


class KeyFlushUnitCache(QuantizedCache):
    """A `QuantizedCache` whose per-token keys leave the residual only in whole units of
    `key_flush_unit` tokens (between R and R + unit - 1 keys stay exact, as with per-channel keys
    over groups of that many tokens); values flush as `QuantizedCache`'s do.

    Raises:
        ValueError: keys that are not per token (reduce="channels"), a unit that is not a
        positive int, `requantize_history`; and `QuantizedCache`'s errors.
    """

    def __init__(self, num_layers, key_scheme, value_scheme=None, *, key_flush_unit, **options):
        if getattr(key_scheme, "reduce", None) != "channels" or options.get("requantize_history"):
            raise ValueError(
                "key_scheme: expected per-token keys (reduce='channels') flushed once, got "
                f"{key_scheme!r} with options {options}"
            )
        super().__init__(num_layers, key_scheme, value_scheme, **options)
        self.key_flush_unit = check_positive_int("key_flush_unit", key_flush_unit)
        self._flushing_keys = False

    def update(self, layer_idx, k, v):
        self._flushing_keys = True  # `QuantizedCache.update` flushes the keys, then the values
        return super().update(layer_idx, k, v)

    def _flush_units(self):
        return self.key_flush_unit, super()._flush_units()[1]  # what `truncate` checks

    def _flush(self, history, residual, scheme):
        flushing_keys, self._flushing_keys = self._flushing_keys, False
        if not flushing_keys:
            return super()._flush(history, residual, scheme)
        unit = self.key_flush_unit
        n = max(0, (residual.shape[2] - self.residual_length) // unit * unit)
        # the parent flushes, a token at a time, every key beyond R it is given: give it n + R
        history, _ = super()._flush(history, residual[:, :, : n + self.residual_length], scheme)
        return history, residual[:, :, n:]


def flush_unit_factory(label: str, residual_length: int = 0):
    """The `cache=` factory of one of `FLUSH_UNIT_LABELS`."""
    if label not in FLUSH_UNIT_LABELS:
        raise ValueError(f"label: expected one of {FLUSH_UNIT_LABELS}, got {label!r}")
    keys, values = quant_schemes()["int4 per-token"]
    if label == FLUSH_UNIT_LABELS[1]:
        values = quant_schemes()["int4 KIVI"][1]
    return KeyFlushUnitCache.factory(
        keys, values, key_flush_unit=KIVI_GROUP, residual_length=residual_length
    )


def quant_flush_unit(out_csv: str, *, seed: int = 0) -> list[dict]:
    """The two controls of `FLUSH_UNIT_LABELS` on SmolLM2 over the course essay, R = 0; rows
    written to `out_csv` (the committed `results/quant_flush_unit.csv`, which a test spot-checks).
    """
    jobs = [("text", label, 0) for label in FLUSH_UNIT_LABELS]
    return run_sweep(
        out_csv, jobs, "flush unit control", lambda task, label, r: flush_unit_factory(label), seed
    )


def main(argv: list[str] | None = None) -> int:
    return run("quant_flush_unit", __doc__, "results/quant_flush_unit.csv", quant_flush_unit, argv)


if __name__ == "__main__":
    raise SystemExit(main())
