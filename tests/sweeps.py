"""Spot checks of a committed sweep file (`results/*_sweep.csv`, rows as
`kvlib.experiments.sweep.run_sweep` writes them): recompute one row of each task and compare."""

from __future__ import annotations

import csv

import numpy as np
import torch

from kvlib.experiments.passkey import PASSKEY_DEPTHS
from kvlib.experiments.sweep import EVICTION_CHUNK, EVICTION_PASSKEY_FILLER, streamed_text_metrics
from kvlib.metrics.passkey import passkey_trial
from kvlib.metrics.quality import course_text
from kvlib.metrics.recall import RECALL_DISTANCES, recall_by_distance


def recorded(path, task: str, policy: str, budget) -> list[dict]:
    """The rows of `path` for one task, policy (or scheme) and budget (or residual length)."""
    with open(path) as f:
        return [
            r
            for r in csv.DictReader(f)
            if (r["task"], r["policy"], r["budget"]) == (task, policy, str(budget))
        ]


def spot_check_recall(path, policy: str, budget, factory, distances=(8, 240)) -> None:
    """The course model's recall through `factory` at the shortest and longest distances matches
    the recorded rows (the documents of each distance are rows of their own in the batch, so two
    distances reproduce what the six-distance sweep computed for them)."""
    from kvlib.loaders.course_model import load_course_model

    rows = recorded(path, "recall", policy, budget)
    assert sorted(int(r["x"]) for r in rows) == list(RECALL_DISTANCES)
    got = recall_by_distance(load_course_model(), distances, cache_factory=factory)
    for row in rows:  # a flipped argmax on another CPU moves a cell by 1/128
        if int(row["x"]) in distances:
            assert abs(got[int(row["x"])] - float(row["value"])) <= 0.02, row


def spot_check_smollm2(path, smollm2, text, passkey=None) -> None:
    """SmolLM2 on the essay (`text` = (policy, budget, factory)) within 5% of the recorded
    metrics, and the recorded passkey trial at depth 0.5 (`passkey`, likewise; None: a file with
    no passkey rows) answered alike."""
    model, tokenizer = smollm2
    essay = torch.tensor([tokenizer.encode(course_text())])
    policy, budget, factory = text
    got = streamed_text_metrics(model, essay, factory(model, *essay.shape))
    rows = recorded(path, "text", policy, budget)
    assert {r["metric"] for r in rows} == set(got)
    for row in rows:
        value = float(row["value"])
        assert abs(got[row["metric"]] - value) <= 0.05 * abs(value) + 0.01, row
    if passkey is None:
        return
    policy, budget, factory = passkey
    (row,) = [r for r in recorded(path, "passkey", policy, budget) if float(r["x"]) == 0.5]
    key = dict(zip(PASSKEY_DEPTHS, np.random.default_rng(0).integers(10_000, 100_000, 5)))[0.5]
    correct, _ = passkey_trial(
        model,
        tokenizer,
        EVICTION_PASSKEY_FILLER,
        0.5,
        int(key),
        cache_factory=factory,
        prefill_chunk_size=EVICTION_CHUNK,
    )
    assert int(correct) == int(row["value"])
