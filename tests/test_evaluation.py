"""kvlib.metrics: teacher-forced decoding, agreement, perplexity and passkey retrieval."""

import math

import pytest
import torch

from kvlib.cache import DynamicCache
from kvlib.metrics.passkey import passkey_prompt
from kvlib.metrics.quality import agreement, decode_logits, perplexity
from kvlib.testing import assert_close
from tests.test_model import TINY, tiny_model


def test_decode_logits_through_the_full_cache_equal_one_forward_pass():
    model = tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    stepped = decode_logits(model, ids, 6, DynamicCache(TINY.num_hidden_layers))
    with torch.no_grad():
        full = model(ids)[0]
    assert stepped.shape == (20 - 6 + 1, TINY.vocab_size)
    assert_close(stepped, full[5:], name="teacher-forced decode", rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"prefill_len: expected an int in \[1, 20\), got 20"):
        decode_logits(model, ids, 20, DynamicCache(TINY.num_hidden_layers))


class NoisyValuesCache(DynamicCache):
    """A 'modified' cache for the test: stores values with noise added."""

    def update(self, layer_idx, k, v):
        noise = torch.randn(v.shape, generator=torch.Generator().manual_seed(layer_idx))
        return super().update(layer_idx, k, v + 0.5 * noise)


def test_agreement_is_perfect_for_the_same_cache_and_not_for_a_modified_one():
    model = tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    full = decode_logits(model, ids, 4, DynamicCache(TINY.num_hidden_layers))
    same = agreement(full, decode_logits(model, ids, 4, DynamicCache(TINY.num_hidden_layers)))
    assert (same.top1, same.mean_kl, same.positions) == (1.0, 0.0, 21)
    noisy = agreement(full, decode_logits(model, ids, 4, NoisyValuesCache(TINY.num_hidden_layers)))
    assert noisy.mean_kl > 0 and noisy.max_kl >= noisy.mean_kl


def test_agreement_matches_kl_by_hand():
    p, q = torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([[0.4, 0.6], [0.3, 0.7]])
    result = agreement(p.log(), q.log())
    kl = [
        0.9 * math.log(0.9 / 0.4) + 0.1 * math.log(0.1 / 0.6),
        0.2 * math.log(0.2 / 0.3) + 0.8 * math.log(0.8 / 0.7),
    ]
    assert result.top1 == 0.5  # the first position's argmax flips, the second's does not
    assert abs(result.mean_kl - sum(kl) / 2) < 1e-6 and abs(result.max_kl - max(kl)) < 1e-6
    with pytest.raises(ValueError, match="expected two"):
        agreement(torch.zeros(2, 3), torch.zeros(3, 3))


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    def uniform(ids):
        return torch.zeros(1, ids.shape[1], 50)

    assert abs(perplexity(uniform, torch.tensor([[1, 2, 3, 4]])) - 50) < 1e-3
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(uniform, torch.tensor([[1]]))


def test_passkey_prompt_hides_the_key_at_the_requested_depth(smollm2):
    _, tokenizer = smollm2
    early = tokenizer.decode(passkey_prompt(tokenizer, 200, 0.0, 48213))
    late = tokenizer.decode(passkey_prompt(tokenizer, 200, 1.0, 48213))
    assert early.count("48213") == late.count("48213") == 2
    assert early.index("48213") < late.index("48213")
    assert late.rstrip().endswith("<|im_start|>assistant")
    with pytest.raises(ValueError, match=r"depth: expected a number in \[0, 1\]"):
        passkey_prompt(tokenizer, 200, 1.5, 48213)


@pytest.mark.recorded
def test_recorded_passkey_sweep_is_reproduced(smollm2):
    """CI recomputes a sample of `results/passkey_smollm2.csv` (`python -m kvlib.metrics
    passkey`): the two shortest fillers, at the middle depth (the longest take ~15 s each)."""
    import csv
    from pathlib import Path

    from kvlib.metrics.passkey import passkey_trial

    model, tokenizer = smollm2
    rows = list(
        csv.DictReader(Path(__file__).parents[1].joinpath("results/passkey_smollm2.csv").open())
    )
    assert len(rows) == 20
    for filler in ("200", "320"):
        row = next(r for r in rows if r["filler_tokens"] == filler and r["depth"] == "0.5")
        correct, prompt_tokens = passkey_trial(
            model, tokenizer, int(filler), 0.5, int(row["passkey"])
        )
        assert (str(correct), prompt_tokens) == (row["correct"], int(row["prompt_tokens"]))


def test_course_text_ships_with_kvlib():
    from kvlib.metrics.quality import course_text

    text = course_text()
    assert "written for the course KV Cache from Scratch" in text and len(text.split()) > 300
    with pytest.raises(FileNotFoundError, match="shipped: \\['kv_cache_essay'\\]"):
        course_text("nope")


def test_passkey_accuracy_counts_seeded_trials(smollm2):
    from kvlib.metrics.passkey import passkey_accuracy

    model, tokenizer = smollm2
    assert passkey_accuracy(model, tokenizer, 200, [0.5]) == 1.0  # the sweep: 20 of 20 correct
    with pytest.raises(ValueError, match="trials_per_depth"):
        passkey_accuracy(model, tokenizer, 200, [0.5], trials_per_depth=0)


def test_wilson_interval_matches_the_formula_by_hand():
    from kvlib.metrics.quality import wilson_interval

    # Wilson (1927) at z = 1.96, values computed by hand from the closed form
    expected = {(0, 5): (0.0, 0.4345), (5, 5): (0.5655, 1.0), (4, 5): (0.3755, 0.9638)}
    for (k, n), (low, high) in expected.items():
        got = wilson_interval(k, n)
        assert abs(got[0] - low) < 1e-4 and abs(got[1] - high) < 1e-4, (k, n, got)
    assert wilson_interval(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    # more trials at the same rate: a narrower interval around it
    narrow, wide = wilson_interval(400, 1000), wilson_interval(4, 10)
    assert wide[0] < narrow[0] < 0.4 < narrow[1] < wide[1]
    for bad in ((6, 5), (-1, 5), (1.0, 5), (True, 5), (1, 0)):
        with pytest.raises(ValueError):
            wilson_interval(*bad)


def test_recall_fact_counts_match_the_documents_recall_scores():
    from kvlib import data
    from kvlib.metrics.recall import recall_fact_counts

    counts = recall_fact_counts((8, 240), num_documents=3)
    for d in (8, 240):
        docs = data.recall_documents(d, 3)
        assert counts[d] == sum(len(doc.answer_positions) for doc in docs)
    assert counts[8] == 12 and counts[240] < counts[8]  # 4 facts fit at 8, fewer at 240


def test_recall_hits_per_document_pool_to_the_rate_and_the_fact_counts():
    """`recall_hits` per document: each document's facts as `recall_fact_counts` counts them,
    hits within them, and pooled per distance they are `recall_by_distance`'s rate."""
    from kvlib.loaders.course_model import load_course_model
    from kvlib.metrics.recall import recall_by_distance, recall_fact_counts, recall_hits

    model = load_course_model()
    hits = recall_hits(model, (8, 240), num_documents=3)
    counts = recall_fact_counts((8, 240), num_documents=3)
    rates = recall_by_distance(model, (8, 240), num_documents=3)
    for d, docs in hits.items():
        assert len(docs) == 3 and all(0 <= h <= n for h, n in docs)
        assert sum(n for _, n in docs) == counts[d]
        assert rates[d] == sum(h for h, _ in docs) / counts[d]
    assert sum(h for h, _ in hits[8]) > 0  # the trained model recalls at the shortest distance
