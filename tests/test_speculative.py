"""kvlib.speculative: verification (greedy and speculative sampling), the prompt-lookup drafter, and
the loop whose greedy output equals plain greedy decoding's over every cache that rolls back."""

import pytest
import torch

from kvlib.cache import DynamicCache, PagedCache, StaticCache
from kvlib.cache.latent import LatentCache
from kvlib.cache.paged_bounds import PageBoundsCache
from kvlib.cache.quantized import QuantizedCache, QuantizedPagedCache
from kvlib.generation import generate
from kvlib.loaders.course_model import load_course_mla_model, load_course_model
from kvlib.quant import QuantScheme
from kvlib.sparse import SparsePagedCache
from kvlib.speculative import (
    Draft,
    SparseSelfDrafter,
    greedy_accept,
    ngram_draft,
    residual_distribution,
    speculative_accept,
    speculative_generate,
)
from kvlib.speculative.tree import tree_attention_mask, tree_depths, verify_tree

INT8 = QuantScheme("int8", reduce="channels")


def one_hot_logits(tokens, vocab=10):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


@pytest.mark.parametrize(
    ("draft", "target", "expected"),
    [
        ([3, 4, 5], [3, 4, 5, 6], (3, 6)),  # all accepted: the bonus token
        ([3, 4, 5], [3, 7, 5, 6], (1, 7)),  # stops at the first mismatch, even if later ones match
        ([3, 4, 5], [8, 4, 5, 6], (0, 8)),  # none: the target's own token
        ([], [2], (0, 2)),  # nothing drafted: a plain decode step
    ],
)
def test_greedy_acceptance_is_the_longest_matching_prefix_then_the_targets_token(
    draft, target, expected
):
    assert greedy_accept(draft, one_hot_logits(target)) == expected


def test_verification_names_a_wrong_shape():
    with pytest.raises(
        ValueError, match=r"target_logits: expected a \(3, V\) tensor, got \(2, 10\)"
    ):
        greedy_accept([1, 2], one_hot_logits([1, 2]))
    with pytest.raises(ValueError, match=r"draft_probs: expected a \(1, V\) tensor"):
        speculative_accept([1], torch.ones(2, 4) / 4, torch.ones(2, 4) / 4)


def test_the_residual_is_the_normalised_positive_part_of_p_minus_q():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual_distribution(p, p), p)  # nothing is ever rejected


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit test: P(chi2 with V - 1 degrees of freedom >= the statistic)."""
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2.0), stat / 2))


def emitted(rule, draws: int, seed: int = 0, draft_temperature: float = 1.0):
    """Counts of the first emitted token, and of the second where the first draft token stood,
    over `draws` steps of k = 2 with fixed p (target) and q (draft) rows over 6 tokens; the draft
    tokens drawn from q at `draft_temperature` (softmax(log q / t)), the rule told q."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, 6, generator=torch.Generator().manual_seed(7)) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, 6, generator=torch.Generator().manual_seed(8)) * 1.5, dim=-1)
    drawn = torch.softmax(q.log() / draft_temperature, dim=-1)
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(draws):
        draft = [int(torch.multinomial(drawn[i], 1, generator=g)) for i in range(2)]
        accepted, token = rule(draft, q, p, g)
        tokens = [*draft[:accepted], token]
        first[tokens[0]] += 1
        if accepted >= 1:
            second[tokens[1]] += 1
    return p, first, second


def resample_from_p(draft, q, p, g):
    """A plausible mistake: on rejection, sample from p instead of the residual."""
    accepted, _ = speculative_accept(draft, q, p, g)
    return accepted, int(torch.multinomial(p[accepted], 1, generator=g))


def test_speculative_sampling_emits_the_targets_distribution():
    """10,000 steps: the first emitted token follows p_0 and, after an accepted first token, the
    second follows p_1 (chi-square p-values above 0.001 for the rule, at a fixed seed); the same
    test rejects resampling from p instead of the residual (p-value below 1e-9: it has the power
    to see the mistake at this sample size), and a draft sampled at temperature 0.8 while the rule
    is told its distribution at 1 (total variation about 0.04 from p_0: below 1e-4)."""
    p, first, second = emitted(speculative_accept, 10_000)
    assert chi_square_p_value(first, p[0]) > 1e-3
    assert second.sum() > 2_500 and chi_square_p_value(second, p[1]) > 1e-3
    _, wrong_first, _ = emitted(resample_from_p, 10_000)
    assert chi_square_p_value(wrong_first, p[0]) < 1e-9
    _, mismatched, _ = emitted(speculative_accept, 10_000, draft_temperature=0.8)
    assert chi_square_p_value(mismatched, p[0]) < 1e-4


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # 3-gram [1, 2, 3] seen before: what followed
        ([1, 2, 3, 9, 1, 2, 3], 1, [9]),
        ([5, 1, 7, 6, 1, 8, 6, 1], 2, [8, 6]),  # the latest earlier [6, 1]
        ([4, 5, 6], 3, []),  # nothing recurs
        ([2, 2, 2, 2], 3, [2]),  # the latest earlier [2, 2, 2] is followed by one token
    ],
)
def test_prompt_lookup_proposes_what_followed_the_latest_earlier_ngram(tokens, k, expected):
    assert ngram_draft(tokens, k) == expected


def test_prompt_lookup_names_bad_arguments():
    with pytest.raises(ValueError, match="k"):
        ngram_draft([1, 2], 0)
    with pytest.raises(ValueError, match="min_ngram: expected at most max_ngram = 2, got 3"):
        ngram_draft([1, 2], 2, max_ngram=2, min_ngram=3)


@pytest.fixture(scope="module")
def course_model():
    return load_course_model()


def caches(model):
    c, paged = model.config, {"block_size": 4}
    return {
        "dynamic": lambda: DynamicCache(c.num_hidden_layers),
        "static": lambda: StaticCache.for_model(model, 1, 128),
        "paged": lambda: PagedCache.for_model(model, 1, 128, **paged),
        "bounds": lambda: PageBoundsCache.for_model(model, 1, 128, **paged),
        "quantized-paged": lambda: QuantizedPagedCache.for_model(
            model, 1, 128, key_scheme=INT8, **paged
        ),
    }


def no_draft(tokens, k):
    return []


def repetitive_prompt(model):
    """A prompt that repeats a random 8-token phrase four times: the drafter's favourite text."""
    phrase = torch.randint(
        0, model.config.vocab_size, (8,), generator=torch.Generator().manual_seed(3)
    )
    return phrase.repeat(4)[None]


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged", "bounds", "quantized-paged"])
def test_greedy_speculation_emits_plain_greedy_tokens_over_every_cache_that_rolls_back(
    course_model, kind
):
    """Prompt lookup over a repetitive prompt, k = 4: the tokens equal greedy decoding's with the
    same cache kind and no draft (and `generate`'s for the dense caches), in fewer forwards."""
    model, make = course_model, caches(course_model)[kind]
    prompt = repetitive_prompt(model)
    tokens, stats = speculative_generate(model, prompt, make(), max_new_tokens=40, k=4)
    plain, plain_stats = speculative_generate(
        model, prompt, make(), max_new_tokens=40, drafter=no_draft
    )
    assert torch.equal(tokens, plain)
    if kind in ("dynamic", "static"):
        assert torch.equal(tokens, generate(model, prompt, 40))
    assert plain_stats.num_drafts == 39 and plain_stats.tokens_per_step == 1.0
    assert stats.num_accepted_tokens > 0 and stats.num_drafts < 39
    assert stats.num_emitted_tokens == 39 == stats.num_drafts + stats.num_accepted_tokens


def test_greedy_speculation_over_mla_latent_cache(course_model):
    model = load_course_mla_model()
    prompt = repetitive_prompt(model)
    make = lambda: LatentCache(model.config.num_hidden_layers)  # noqa: E731
    tokens, stats = speculative_generate(model, prompt, make(), max_new_tokens=24, k=3)
    plain, _ = speculative_generate(model, prompt, make(), max_new_tokens=24, drafter=no_draft)
    assert torch.equal(tokens, plain) and stats.num_drafts < 23


def test_a_drafter_that_is_often_wrong_still_changes_nothing(course_model):
    """Every draft token wrong on purpose: each step rolls back all k and emits one token."""
    model = course_model
    prompt = repetitive_prompt(model)
    vocab = model.config.vocab_size
    wrong = lambda tokens, k: [(tokens[-1] + 1 + i) % vocab for i in range(k)]  # noqa: E731
    plain, _ = speculative_generate(
        model,
        prompt,
        PagedCache.for_model(model, 1, 128, block_size=4),
        max_new_tokens=20,
        drafter=no_draft,
    )
    cache = PagedCache.for_model(model, 1, 128, block_size=4)
    tokens, stats = speculative_generate(model, prompt, cache, max_new_tokens=20, drafter=wrong)
    assert torch.equal(tokens, plain)
    assert cache.length == prompt.shape[1] + 19  # all but the newest token are cached
    assert cache.num_blocks_in_use == -(-cache.length // 4)  # every rolled-back block returned
    cache.manager.check_invariants()


def test_the_loop_refuses_what_it_cannot_do(course_model):
    model = course_model
    prompt = repetitive_prompt(model)
    with pytest.raises(ValueError, match=r"input_ids: expected \(1, T\) int64"):
        speculative_generate(model, prompt.repeat(2, 1), DynamicCache(4), max_new_tokens=4)
    with pytest.raises(ValueError, match="drafter: expected token ids in"):
        speculative_generate(
            model, prompt, DynamicCache(4), max_new_tokens=4, drafter=lambda t, k: [10**6]
        )
    requantizing = QuantizedCache(4, INT8, residual_length=4, requantize_history=True)
    with pytest.raises(NotImplementedError, match="QuantizedCache does not roll back"):
        speculative_generate(model, prompt, requantizing, max_new_tokens=8)


KIVI = (QuantScheme("int4", False, "tokens", 32), QuantScheme("int4", False, "channels", 32))


def test_kivi_speculates_while_no_flush_falls_inside_a_rollback(course_model):
    """KIVI's int4 (keys per channel in groups of G = 32 tokens, values per token), k = 4, over
    the 32-token prompt. R = 0: the prefill quantizes keys 0..31 (one group) and the run's
    longest length, 63, stays below the next flush point, 64; values are quantized as they
    arrive, so a cache that never saw the rejected tokens holds no value residual either: every
    rollback is exact and the tokens equal plain greedy decoding's over the same cache. R = 4,
    a longer residual: the first flush point is 36, a verification writes past it, rejects a
    token before it, and the loop stops there with the refusal, the cache as the write left it."""
    model = course_model
    prompt = repetitive_prompt(model)

    def kivi(residual):
        return QuantizedCache(model.config.num_hidden_layers, *KIVI, residual_length=residual)

    cache = kivi(0)
    tokens, stats = speculative_generate(model, prompt, cache, max_new_tokens=32, k=4)
    plain, _ = speculative_generate(model, prompt, kivi(0), max_new_tokens=32, drafter=no_draft)
    assert torch.equal(tokens, plain)
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert cache.keys[0].num_tokens == 32 and cache.values[0].num_tokens == cache.length == 63
    refused = kivi(4)
    with pytest.raises(
        NotImplementedError,
        match=r"QuantizedCache cannot roll back to length 35: a flush since then quantized the "
        r"keys of positions 0\.\.31, which a cache that never saw positions 35\.\.38 holds",
    ):
        speculative_generate(model, prompt, refused, max_new_tokens=32, k=4)
    assert refused.length == 39 and refused.keys[0].num_tokens == 32  # as the write left it


@pytest.mark.parametrize("budget_pages", [2, 4])
def test_self_speculation_over_a_few_pages_emits_plain_greedy_tokens(course_model, budget_pages):
    """The target drafts over `budget_pages` pages of its own cache (2: the sink page and the
    newest, a window; 4: Quest's picks), then verifies densely: the tokens equal dense greedy
    decoding's, the cache ends holding exactly the emitted tokens (no draft K/V left), and the
    draft steps read fewer K/V tokens than they held (the cache counts single-token forwards
    only: the draft steps, not the verification chunks)."""
    model = course_model
    prompt = torch.randint(
        0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(5)
    )

    def sparse_cache():
        return SparsePagedCache.for_model(
            model, 1, 160, block_size=4, dense_layers=1, decode_attention="torch"
        )

    plain, _ = speculative_generate(
        model, prompt, sparse_cache(), max_new_tokens=32, drafter=no_draft
    )
    assert torch.equal(plain, generate(model, prompt, 32))
    cache = sparse_cache()
    drafter = SparseSelfDrafter(model, cache, budget_pages)
    tokens, stats = speculative_generate(
        model, prompt, cache, max_new_tokens=32, k=3, drafter=drafter
    )
    assert torch.equal(tokens, plain)
    assert stats.num_accepted_tokens > 0 and cache.budget_pages is None
    assert cache.length == 64 + 31
    counts = cache.read_counts()
    assert counts["kv_tokens_read"] < counts["kv_tokens_held"]


def test_self_speculation_needs_a_sparse_cache(course_model):
    with pytest.raises(TypeError, match="expected a kvlib.sparse.SparsePagedCache"):
        SparseSelfDrafter(course_model, DynamicCache(4), 2)
    cache = SparsePagedCache.for_model(course_model, 1, 32, block_size=4, decode_attention="torch")
    with pytest.raises(ValueError, match="budget_pages: expected at least sink_pages"):
        SparseSelfDrafter(course_model, cache, 1)


def test_verify_cost_writes_ratios_and_the_recording_holds_the_claim(tmp_path):
    """`verify_cost --quick` writes one row per q with q = 1's ratio 1; its 16-token forward costs
    well under 16 single steps (generous: 4x against about 1.4 measured, with another core
    busy). The recorded file covers both models at two contexts each; there q tokens cost less
    than q steps, and 16 less than a third of 16: the tokens speculation verifies come nearly
    free."""
    import csv

    from kvlib.course.recorded import recorded_file
    from kvlib.experiments import verify_cost

    out = tmp_path / "verify_cost.csv"
    assert verify_cost.main(["--quick", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [int(r["query_tokens"]) for r in rows] == list(verify_cost.QUERY_TOKENS)
    assert float(rows[0]["ratio"]) == 1.0 and float(rows[-1]["ratio"]) < 4
    recorded = list(csv.DictReader(open(recorded_file("verify_cost.csv"))))
    runs = {(r["model"], int(r["context"])) for r in recorded}
    assert runs == {(m, c) for m, cs in verify_cost.CONTEXTS.items() for c in cs}
    for r in recorded:
        q, ratio = int(r["query_tokens"]), float(r["ratio"])
        assert ratio < q if q > 1 else ratio == 1.0
        assert ratio < 16 / 3 or q < 16


def test_a_tree_mask_lets_each_node_see_its_ancestors_only():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = [-1, 0, 0, 1, 1, 2]
    mask = tree_attention_mask(parents)
    assert mask[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert tree_depths(parents) == [0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="node 2's parent among nodes 0..1"):
        tree_depths([-1, 0, 2])


TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # the root, two candidates, then three, then one


def test_verifying_a_tree_equals_verifying_each_branch_alone(course_model):
    """One forward over the tree with its mask and depth positions gives, at every node, the
    logits of a plain causal forward over that node's branch alone (float32, to 1e-5)."""
    import copy

    model = course_model
    prompt = repetitive_prompt(model)
    cache = DynamicCache(model.config.num_hidden_layers)
    with torch.no_grad():
        model(prompt, cache=cache)
    tokens = [5, 17, 42, 8, 99, 3, 64]
    depths = tree_depths(TREE_PARENTS)
    past = cache.length
    with torch.no_grad():
        tree_logits = model(
            torch.tensor([tokens]),
            cache=copy.deepcopy(cache),
            position_ids=torch.tensor([[past + d for d in depths]]),
            tree_mask=tree_attention_mask(TREE_PARENTS),
        )[0]
        for leaf in (4, 5, 6, 3):
            branch = [leaf]
            while TREE_PARENTS[branch[0]] != -1:
                branch.insert(0, TREE_PARENTS[branch[0]])
            alone = model(torch.tensor([[tokens[i] for i in branch]]), cache=copy.deepcopy(cache))[
                0
            ]
            assert torch.allclose(alone, tree_logits[branch], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged", "bounds"])
def test_greedy_tree_speculation_emits_plain_greedy_tokens(course_model, kind):
    """Each step drafts a tree whose first branch is prompt lookup's guess and whose other
    candidates are wrong on purpose; the accepted branch's K/V is moved into place and the rest
    rolled back: the tokens equal plain greedy decoding's, in fewer forwards, and the cache holds
    exactly the emitted tokens but the newest, whose K/V give the plain cache's next logits (the
    tokens alone would not show misplaced K/V: the course model's argmax survives them)."""
    model, make = course_model, caches(course_model)[kind]
    prompt, n_new, vocab = repetitive_prompt(course_model), 30, course_model.config.vocab_size
    plain_cache = make()
    plain, _ = speculative_generate(
        model, prompt, plain_cache, max_new_tokens=n_new, drafter=no_draft
    )
    cache, out, forwards = make(), [], 0
    with torch.no_grad():
        next_token = int(model(prompt, cache=cache)[0, -1].argmax())
    while True:
        out.append(next_token)
        if len(out) >= n_new:
            break
        guess = ngram_draft(prompt[0].tolist() + out, 2) or [0]
        decoy = [(t + 1) % vocab for t in guess]
        tokens, parents = [next_token, decoy[0], guess[0]], [-1, 0, 0]  # the decoy first
        if len(guess) > 1:
            tokens += [decoy[1], guess[1]]
            parents += [2, 2]
        accepted, next_token = verify_tree(model, cache, tokens, parents)
        out += accepted
        forwards += 1
    assert out[:n_new] == plain[0, prompt.shape[1] :].tolist()
    assert forwards < n_new - 1
    assert cache.length == prompt.shape[1] + len(out) - 1
    cache.truncate(plain_cache.length)  # the same tokens cached: the same next logits
    probe = torch.tensor([[plain[0, -1]]])
    with torch.no_grad():
        got, expected = model(probe, cache=cache)[0, -1], model(probe, cache=plain_cache)[0, -1]
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)


def second_token_counts(model, prompt, drafter, runs: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(model.config.vocab_size)
    for _ in range(runs):
        cache = DynamicCache(model.config.num_hidden_layers)
        tokens, stats = speculative_generate(  # 3 tokens: the second is a verified draft's
            model,
            prompt,
            cache,
            max_new_tokens=3,
            k=1,
            drafter=drafter,
            temperature=1.0,
            generator=g,
        )
        assert stats.num_draft_tokens == 1
        counts[tokens[0, prompt.shape[1] + 1]] += 1
    return counts


def second_token_distribution(model, prompt) -> torch.Tensor:
    """The exact distribution of the second token sampled after `prompt` at temperature 1,
    sum_x p(x) p(y | x), (V,) float64."""
    with torch.no_grad():
        first = torch.softmax(model(prompt)[0, -1].double(), -1)  # (V,)
        vocab = first.shape[0]
        both = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second = torch.softmax(model(both)[:, -1].double(), -1)  # (V, V): row x is p(. | x)
    return first @ second


def pooled_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """`chi_square_p_value` of `counts` against `expected`, the cells expecting fewer than 5
    pooled into one."""
    big = expected * counts.sum() >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    probs = torch.cat([expected[big], expected[~big].sum()[None]])
    return chi_square_p_value(observed, probs / probs.sum())


def test_sampled_speculation_keeps_the_targets_distribution(course_model):
    """300 runs of three tokens at temperature 1, drafting one token (the last one again, a one-hot
    q): the second token's frequencies match the exact sum_x p(x) p(y | x) (chi-square over the
    cells expecting 5 or more, the rest pooled: p-value above 0.001 at a fixed seed). A drafter
    that misreports its q grossly (claims uniform, proposes one token: total variation 0.70 from
    the target) fails the same test (below 1e-6); the subtler mismatch of a draft temperature is
    the fixed-row test's (test_speculative_sampling_emits_the_targets_distribution)."""
    model = course_model
    prompt = repetitive_prompt(model)[:, :12]
    expected = second_token_distribution(model, prompt)
    vocab = expected.shape[0]
    repeat_last = lambda tokens, k: [tokens[-1]]  # noqa: E731
    counts = second_token_counts(model, prompt, repeat_last, 300)
    assert pooled_p_value(counts, expected) > 1e-3

    def liar(tokens, k):
        return Draft([tokens[-1]], torch.full((1, vocab), 1.0 / vocab, dtype=torch.float64))

    assert pooled_p_value(second_token_counts(model, prompt, liar, 300), expected) < 1e-6


def test_bad_drafts_and_caches_are_refused_by_name(course_model):
    """A draft token its own q could not have drawn, an out-of-range id in a Draft, a sparse cache
    whose budget is already set, a tree on a cache that cannot move tokens or on a sliding-window
    model: each refused with the reason, before anything changes."""
    model = course_model
    q = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="probability above 0"):
        speculative_accept([0], q, torch.full((2, 2), 0.5, dtype=torch.float64))
    prompt = repetitive_prompt(model)
    bad = lambda tokens, k: Draft([10**6], torch.ones(1, 128) / 128)  # noqa: E731
    with pytest.raises(ValueError, match="drafter: expected token ids in"):
        speculative_generate(model, prompt, DynamicCache(4), max_new_tokens=4, drafter=bad)
    cache = SparsePagedCache.for_model(
        model, 1, 64, block_size=4, budget_pages=2, decode_attention="torch"
    )
    with pytest.raises(ValueError, match="cache: expected budget_pages None"):
        SparseSelfDrafter(model, cache, 2)
    kivi = QuantizedCache(4, INT8, residual_length=4)
    with torch.no_grad():
        model(prompt, cache=kivi)
    with pytest.raises(NotImplementedError, match="QuantizedCache does not move tokens"):
        verify_tree(model, kivi, [1, 2, 3], [-1, 0, 0])
    import dataclasses

    from kvlib.model import LlamaModel

    windowed = LlamaModel(dataclasses.replace(model.config, sliding_window=8))
    with pytest.raises(ValueError, match="tree_mask: a sliding window counts positions"):
        windowed(torch.tensor([[1, 2]]), tree_mask=torch.ones(2, 2, dtype=torch.bool))


@pytest.mark.recorded
def test_recorded_spec_acceptance_spot_check(course_model):
    """Two of `results/spec_acceptance.csv`'s course-model rows recomputed (prompt 0, k = 4, prompt
    lookup and self-speculation at 2 pages): greedy runs, so every count is equal, and the run's
    tokens are plain greedy decoding's."""
    import csv

    from kvlib.course.recorded import recorded_file
    from kvlib.experiments import spec_acceptance as S

    recorded = {
        (r["drafter"], r["budget_pages"]): r
        for r in csv.DictReader(open(recorded_file("spec_acceptance.csv")))
        if r["model"] == "course model" and r["k"] == "4" and r["prompt"] == "0"
    }
    prompt = S.course_prompts()[0]
    plain = generate(course_model, prompt, S.NEW_TOKENS["course model"])
    for drafter, budget in (("ngram", None), ("self", 2)):
        tokens, values = S.run_one(course_model, prompt, "course model", drafter, 4, budget)
        assert torch.equal(tokens, plain)
        row = recorded[drafter, str(budget or "")]
        assert {name: int(row[name]) for name in values} == values, (drafter, row)
