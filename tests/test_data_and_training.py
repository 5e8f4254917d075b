"""kvlib.data's documents are what they claim to be; kvlib.training runs end to end; the committed
course model loads and recalls."""

import json

import numpy as np
import pytest
import torch

from kvlib import data
from kvlib.experiments.train_course_model import main
from kvlib.loaders.course_model import COURSE_MODEL_DIR
from kvlib.loaders.hf import load_hf_checkpoint
from kvlib.training import evaluate


@pytest.mark.parametrize("seed", range(5))
def test_documents_store_and_query_facts(seed):
    document = data.make_document(np.random.default_rng(seed))
    tokens = document.tokens
    assert (
        tokens.shape == (data.DOC_LEN,) and tokens[0] == data.BOS and tokens.max() < data.VOCAB_SIZE
    )
    assert len(document.answer_positions) == len(document.distances) > 8
    for answer, distance in zip(document.answer_positions, document.distances):
        assert tokens[answer - 2] == data.GET and tokens[answer - distance - 2] == data.SET
        assert tokens[answer - 1] == tokens[answer - distance - 1]  # the same key
        assert tokens[answer] == tokens[answer - distance]  # the stored value is the answer
    first = document.copy_positions[0] - 8
    span = tokens[first : first + 16]
    # the span occurred earlier
    assert any(np.array_equal(tokens[s : s + 16], span) for s in range(1, first - 15))


def test_controlled_distances_and_drills():
    for distance in (8, 64, 240):
        for document in data.recall_documents(distance, 4):
            assert document.distances and set(document.distances) == {distance}
    drill = data.make_drill(np.random.default_rng(0))
    for answer, distance in zip(drill.answer_positions, drill.distances):
        assert (
            drill.tokens[answer] == drill.tokens[answer - distance]
            and drill.tokens[answer - 2] == data.GET
        )


def test_generation_is_deterministic():
    first, second = (next(data.batches(3, 4)) for _ in range(2))
    assert np.array_equal(first, second)
    assert not np.array_equal(first, next(data.batches(4, 4)))
    assert [data.token_name(t) for t in (0, 1, 2, 3, 8, 40, 72)] == [
        "PAD",
        "BOS",
        "SET",
        "GET",
        "k0",
        "v0",
        "w0",
    ]


def test_training_runs_and_saves_a_loadable_checkpoint(tmp_path):
    # one thread: two beside the other test worker's one on 2 cores ran this 8x slower (104 s)
    assert main(["--scale", "0.002", "--out", str(tmp_path), "--threads", "1"]) == 0
    model = load_hf_checkpoint(tmp_path)
    log = [json.loads(line) for line in (tmp_path / "training_log.jsonl").read_text().splitlines()]
    assert (
        log[-1]["step"] == 12
        and "recall_accuracy" in log[-1]
        and (tmp_path / "loss_curve.png").stat().st_size > 0
    )
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, data.VOCAB_SIZE)


def test_committed_course_model_recalls():
    model = load_hf_checkpoint(COURSE_MODEL_DIR)
    results = evaluate(model, num_documents=16, distances=(8, 64))
    chance = 1 / len(data.VALUES)
    assert results["recall_accuracy"][8] > 0.8 and results["recall_accuracy"][64] > 10 * chance
    assert results["heldout_loss"] < 2.2
