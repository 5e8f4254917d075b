"""kvlib.speculative.DraftModelDrafter and the draft course model (chapter 16): speculation drafted
by a small model keeps greedy decoding's tokens and sampling's distribution, the draft model's own
cache follows the emitted tokens exactly through rollbacks, the draft is several times cheaper
than the target, and the shipped weights and `results/draft_model.csv` agree with a rerun (marked
`recorded`)."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlib import data
from kvlib.cache import DynamicCache
from kvlib.generation import generate
from kvlib.loaders.course_draft import DRAFT_CONFIG, DRAFT_MODEL_DIR, load_course_draft_model
from kvlib.loaders.course_model import COURSE_CONFIG, COURSE_MODEL_DIR, load_course_model
from kvlib.model import LlamaModel
from kvlib.speculative import Draft, DraftModelDrafter, speculative_generate
from tests.test_speculative import pooled_p_value, second_token_counts, second_token_distribution

RESULTS = Path(__file__).resolve().parents[1] / "results" / "draft_model.csv"


@pytest.fixture(scope="module")
def target():
    return load_course_model()


@pytest.fixture(scope="module")
def draft():
    return load_course_draft_model()


def prompts() -> list[torch.Tensor]:
    """Three (1, T) int64 prompts: two document openings with facts to recall, one with none."""
    docs = [data.make_document(np.random.default_rng(seed)) for seed in (3, 4)]
    recall = data.recall_documents(32, 1)[0]
    return [
        torch.from_numpy(docs[0].tokens[:64])[None],
        torch.from_numpy(docs[1].tokens[:40])[None],
        torch.from_numpy(recall.tokens[:96])[None],
    ]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_drafted_by_the_draft_model_equals_greedy_decoding(target, draft, k):
    """Token-identical to `generate` for every prompt, with some drafts accepted (the draft
    model predicts the target's text), and one draft forward per drafted token (a call's
    catch-up forward drafts its first token)."""
    accepted = 0
    for prompt in prompts():
        drafter = DraftModelDrafter(draft, target)
        cache = DynamicCache(target.config.num_hidden_layers)
        tokens, stats = speculative_generate(
            target, prompt, cache, max_new_tokens=32, k=k, drafter=drafter
        )
        assert torch.equal(tokens, generate(target, prompt, 32))
        assert drafter.num_forwards == stats.num_draft_tokens  # one per drafted token
        accepted += stats.num_accepted_tokens
    assert accepted > 0


def test_greedy_drafts_are_the_draft_models_own_greedy_continuation(draft, target):
    """Each call's k tokens equal plain greedy decoding of the draft model after the same tokens,
    after earlier calls left rejected drafts in its cache."""
    drafter = DraftModelDrafter(draft, target)
    tokens = prompts()[0][0].tolist()
    for k, accept in [(4, 1), (3, 3), (5, 0), (2, 2), (6, 4)]:
        guess = drafter(tokens, k)
        plain = generate(draft, torch.tensor([tokens]), k)[0, len(tokens) :].tolist()
        assert guess == plain, (k, accept)
        rejected = (guess[accept] + 1) % 128 if accept < k else guess[-1]
        tokens = tokens + guess[:accept] + [rejected]


def snapshot(cache: DynamicCache) -> list[torch.Tensor]:
    return [t.clone() for t in cache.keys + cache.values]


def test_the_draft_cache_after_random_rollbacks_holds_exactly_the_emitted_tokens(draft, target):
    """40 calls with random k, accept lengths and target tokens: after each, the draft cache holds
    the tokens so far and the drafts but the last (`cached_tokens`, `length`); the K/V it kept
    from before the call are bitwise what they were (rollback changes nothing it keeps, so no
    rejected draft's K/V survives), and the whole cache equals a fresh draft cache fed the same
    tokens in one forward (to 1e-5: the two split the work into different matrix shapes)."""
    rng = np.random.default_rng(0)
    drafter = DraftModelDrafter(draft, target)
    tokens = prompts()[1][0].tolist()
    before, held_before = None, []
    for _ in range(40):
        k = int(rng.integers(1, 6))
        guess = drafter(tokens, k)
        assert drafter.cached_tokens == tokens + guess[:-1]
        assert drafter.cache.length == len(drafter.cached_tokens)
        kept = 0
        while kept < min(len(held_before), len(tokens) - 1) and held_before[kept] == tokens[kept]:
            kept += 1
        after = snapshot(drafter.cache)
        if before is not None:
            for old, new in zip(before, after):
                assert torch.equal(old[:, :, :kept], new[:, :, :kept])
        fresh = DynamicCache(draft.config.num_hidden_layers)
        with torch.no_grad():
            draft(torch.tensor([drafter.cached_tokens]), cache=fresh)
        for got, expected in zip(after, snapshot(fresh)):
            difference = (got - expected).abs().max().item()
            assert got.shape == expected.shape and difference < 1e-5, difference
        accept = int(rng.integers(0, k + 1))
        bonus = int(rng.integers(0, 128))
        if accept < k and bonus == guess[accept]:
            bonus = (bonus + 1) % 128  # a real rejection
        tokens = tokens + guess[:accept] + [bonus]
        before, held_before = after, list(drafter.cached_tokens)


def test_sampled_drafts_come_from_the_draft_models_distribution(draft, target):
    """At temperature 0.7 each row of `probs` is the draft model's softmax(logits / 0.7) after the
    tokens so far and the drafts before it (float64, to 1e-6 of a fresh forward), and each draft
    token is the draw a generator in the same state makes from that row."""
    drafter = DraftModelDrafter(
        draft, target, temperature=0.7, generator=torch.Generator().manual_seed(5)
    )
    replay = torch.Generator().manual_seed(5)
    tokens = prompts()[2][0].tolist()
    for k, accept in [(4, 2), (3, 3), (5, 0)]:
        proposed = drafter(tokens, k)
        assert isinstance(proposed, Draft) and proposed.probs.shape == (k, 128)
        assert proposed.probs.dtype == torch.float64
        with torch.no_grad():
            logits = draft(torch.tensor([tokens + proposed.tokens[:-1]]))[0, len(tokens) - 1 :]
        expected = torch.softmax(logits.double() / 0.7, dim=-1)  # (k, V)
        assert torch.allclose(proposed.probs, expected, atol=1e-6, rtol=0)
        for row, token in zip(proposed.probs, proposed.tokens):
            assert int(torch.multinomial(row, 1, generator=replay)) == token
        tokens = tokens + proposed.tokens[:accept] + [7]


def test_sampled_speculation_drafted_by_the_draft_model_keeps_the_targets_distribution(
    target, draft
):
    """300 runs of 3 tokens at temperature 1, k = 1 (the second token is a verified draft's): its
    frequencies match the target's exact sum_x p(x) p(y | x) (chi-square over the cells expecting
    5 or more, the rest pooled: p-value above 0.001 at a fixed seed)."""
    prompt = prompts()[2][:, :20]
    generator = torch.Generator().manual_seed(1)  # the drafter's draws; the loop's are seeded 0
    drafter = DraftModelDrafter(draft, target, temperature=1.0, generator=generator)
    counts = second_token_counts(target, prompt, drafter, 300)
    assert pooled_p_value(counts, second_token_distribution(target, prompt)) > 1e-3


def matmul_flops_per_token(config, context: int) -> int:
    """2 multiply-adds per weight of the layers and the LM head, plus attention's QK^T and PV
    over `context` cached tokens (the embedding lookup is no matmul)."""
    d, h, h_kv, head = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    projections = d * h * head * 2 + d * h_kv * head * 2  # q, o; k, v
    mlp = 3 * d * config.intermediate_size
    attention = 2 * h * head * context
    per_layer = 2 * (projections + mlp + attention)
    return config.num_hidden_layers * per_layer + 2 * d * config.vocab_size


def test_the_draft_model_is_several_times_cheaper_per_token_than_the_target():
    """From the configs: about 1/7 of the parameters, 1/6.5 of the matmul FLOPs per token at 176
    tokens of context (the measured prompts' 128 + 48), 1/4 of the K/V bytes per token."""
    draft_parameters = LlamaModel(DRAFT_CONFIG).num_parameters
    target_parameters = LlamaModel(COURSE_CONFIG).num_parameters
    assert draft_parameters == 117_056 and target_parameters * 10 // draft_parameters == 71
    ratio = matmul_flops_per_token(COURSE_CONFIG, 176) / matmul_flops_per_token(DRAFT_CONFIG, 176)
    assert 5 < ratio < 8, ratio

    def kv_values_per_token(c):
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim

    assert kv_values_per_token(COURSE_CONFIG) == 4 * kv_values_per_token(DRAFT_CONFIG)


def test_bad_arguments_are_named(draft, target):
    import dataclasses

    other = LlamaModel(dataclasses.replace(DRAFT_CONFIG, vocab_size=64))
    with pytest.raises(
        ValueError, match="draft_model: expected the target's vocab_size 128, got 64"
    ):
        DraftModelDrafter(other, target)
    with pytest.raises(TypeError, match="target: expected a model with config.vocab_size"):
        DraftModelDrafter(draft, object())
    with pytest.raises(ValueError, match="temperature"):
        DraftModelDrafter(draft, target, temperature=-1.0)
    drafter = DraftModelDrafter(draft, target)
    with pytest.raises(ValueError, match="k: expected an int >= 1, got 0"):
        drafter([1, 2, 3], 0)
    with pytest.raises(ValueError, match="tokens: expected at least one token id"):
        drafter([], 2)
    assert drafter.cache.length == 0 and drafter.num_forwards == 0  # nothing ran


def test_the_shipped_draft_model_and_its_log_are_what_the_recording_says(draft):
    """The shipped weights have `DRAFT_CONFIG`'s layout and parameters; the held-out loss, copy
    and recall accuracy of both training logs' last evaluation are the CSV's columns, and the
    draft's loss is the one the experiment's docstring states."""
    assert draft.config == DRAFT_CONFIG and draft.num_parameters == 117_056
    with RESULTS.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 32 and {int(r["draft_parameters"]) for r in rows} == {117_056}
    for who, folder in (("draft", DRAFT_MODEL_DIR), ("target", COURSE_MODEL_DIR)):
        log = [
            json.loads(line) for line in (folder / "training_log.jsonl").read_text().splitlines()
        ]
        last = [entry for entry in log if "heldout_loss" in entry][-1]
        for column, value in [
            ("heldout_loss", last["heldout_loss"]),
            ("copy_accuracy", last["copy_accuracy"]),
            ("recall_64", last["recall_accuracy"]["64"]),
        ]:
            assert {float(r[f"{who}_{column}"]) for r in rows} == {round(value, 4)}, column
    assert {float(r["target_heldout_loss"]) for r in rows} == {2.0431}
    from kvlib.experiments import draft_model as experiment

    prose = " ".join(experiment.__doc__.split())
    losses = {float(r["draft_heldout_loss"]) for r in rows}
    assert f"held-out loss {round(losses.pop(), 3)} nats/token" in prose


@pytest.mark.recorded
def test_recorded_draft_acceptance_is_reproduced(target, draft):
    """CI recomputes 4 rows of `results/draft_model.csv` (`python -m
    kvlib.experiments.draft_model --skip-training`): prompts 0 and 5 at k = 2 and 8, every count
    equal (greedy: exact)."""
    from kvlib.experiments.draft_model import measure
    from kvlib.experiments.spec_acceptance import course_prompts

    with RESULTS.open() as f:
        recorded = {(r["k"], r["prompt"]): r for r in csv.DictReader(f)}
    chosen = [course_prompts()[i] for i in (0, 5)]
    for row in measure(target, draft, ks=(2, 8), prompts=chosen):
        index = (0, 5)[row["prompt"]]
        expected = recorded[(str(row["k"]), str(index))]
        for column in ("steps", "draft_tokens", "accepted_tokens", "emitted_tokens", "forwards"):
            assert int(expected[column]) == row[column], (column, row, expected)
        assert int(expected["draft_forwards"]) == row["draft_forwards"], (row, expected)
