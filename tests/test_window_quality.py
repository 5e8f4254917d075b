"""`kvlib.experiments.window_quality` (chapter 17): the mask is the sliding window (plus sinks) the
rest of kvlib uses, and the recorded file's largest-window rows are recomputed (spot check)."""

import csv

import pytest
import torch

from kvlib.experiments import window_quality as Q
from kvlib.ops.attention import visible


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("sinks", [0, 2])
def test_the_mask_is_the_window_of_visible_plus_the_sinks(window, sinks):
    positions = torch.arange(12)
    expected = visible(positions[None, :], positions[:, None], window)
    expected |= (positions[None, :] < sinks) & (positions[None, :] <= positions[:, None])
    assert torch.equal(Q.window_mask(12, window, sinks), expected)


@pytest.mark.recorded
def test_recorded_window_quality_spot_check(tmp_path):
    """The W = 256 rows (no sinks and 4 sinks) recomputed from scratch: the same model, text and
    mask, so the means agree to the CSV's rounding (1e-4 relative on the KL: BLAS sums differ)."""
    from kvlib.course.recorded import recorded_file

    out = tmp_path / "window_quality.csv"
    assert Q.main(["--quick", "--out", str(out)]) == 0
    fresh = {r["sinks"]: r for r in csv.DictReader(open(out))}
    recorded = {
        r["sinks"]: r
        for r in csv.DictReader(open(recorded_file("window_quality.csv")))
        if r["window"] == "256"
    }
    assert set(fresh) == set(recorded) == {"0", "4"}
    for sinks, row in fresh.items():
        for name in ("mean_kl", "perplexity", "top1_agreement", "full_perplexity"):
            assert float(row[name]) == pytest.approx(
                float(recorded[sinks][name]), rel=1e-3, abs=2e-3
            )
