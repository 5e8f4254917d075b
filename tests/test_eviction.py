"""kvlib.cache.evicting: every policy equals the full cache when nothing needs evicting, and keeps
exactly the tokens a brute-force re-statement of its rule keeps; the kernel-wall helpers; the
committed sweep, spot-checked."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvlib.cache import DynamicCache
from kvlib.cache.evicting import EvictingCache, rerotate_keys, token_scores_from_lse
from kvlib.cache.eviction_policies import H2O, TOVA, RandomEviction, SnapKV, StreamingLLM
from kvlib.errors import UnsupportedConfigError
from kvlib.experiments.eviction_sweep import eviction_factory
from kvlib.generation import generate
from kvlib.layers.llama import apply_rope, rope_cos_sin
from kvlib.metrics.quality import decode_logits, streamed_logits
from kvlib.model import LlamaModel
from tests.sweeps import spot_check_recall, spot_check_smollm2
from tests.test_mla import MLA
from tests.test_model import TINY, tiny_model

RESULTS = Path(__file__).parent.parent / "results" / "eviction_sweep.csv"
POLICIES = [
    lambda: StreamingLLM(),
    lambda: StreamingLLM(0),
    lambda: H2O(),
    lambda: H2O(0.25, normalize=True),
    lambda: TOVA(),
    lambda: SnapKV(4, 3),
    lambda: RandomEviction(3),
]


@pytest.fixture(scope="module")
def gqa_model():
    return tiny_model()  # 3 layers, 4 query heads over 2 KV heads (GQA), random norms


@pytest.mark.parametrize("make_policy", POLICIES)
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_unlimited_budget_is_the_full_cache_exactly(gqa_model, make_policy, positions):
    ids = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    factory = EvictingCache.factory(make_policy(), 40, positions=positions)
    for kwargs in ({}, {"prefill_chunk_size": 5}, {"num_beams": 3}, {"num_samples": 2}):
        torch.manual_seed(2)
        expected = generate(gqa_model, ids, 20, cache="dynamic", **kwargs)
        torch.manual_seed(2)
        assert torch.equal(generate(gqa_model, ids, 20, cache=factory, **kwargs), expected), kwargs
    full = decode_logits(gqa_model, ids[:1], 4, DynamicCache(TINY.num_hidden_layers))
    cache = factory(gqa_model, 1, 12)
    assert torch.equal(decode_logits(gqa_model, ids[:1], 4, cache), full)
    assert cache.evicted == 0 and cache.length == 12


def _drive(cache, steps, num_heads, num_kv_heads, dim, seed=0, chunk=1):
    """Feed one layer random q/k/v, `chunk` tokens per forward; return the kept positions after
    each forward and the inputs."""
    g = torch.Generator().manual_seed(seed)
    qs = torch.randn(1, num_heads, steps, dim, generator=g, dtype=torch.float64)
    ks = torch.randn(1, num_kv_heads, steps, dim, generator=g, dtype=torch.float64)
    vs = torch.randn(1, num_kv_heads, steps, dim, generator=g, dtype=torch.float64)
    kept = []
    for start in range(0, steps, chunk):
        end = min(start + chunk, steps)
        cache.begin_forward(end - start, None)
        handle = cache.update(0, ks[:, :, start:end], vs[:, :, start:end])
        cache.attention_backend(qs[:, :, start:end], handle)
        cache.advance(end - start)
        kept.append(cache.positions(0)[0].tolist())
    return kept, qs[0], ks[0]


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def _brute_force(name, budget, qs, ks, chunk, *, window=4, kernel=3, sinks=4, recent=0.5):
    """Each policy's rule re-stated with Python lists, one KV head at a time (TOVA: all heads)."""
    num_heads, steps, dim = qs.shape
    num_kv_heads = ks.shape[0]
    group = num_heads // num_kv_heads
    lists = [[] for _ in range(num_kv_heads)]
    score = [dict() for _ in range(num_kv_heads)]
    history = []

    def weights(h, i, tokens):  # query head h at position i over the visible tokens
        visible = [j for j in tokens if j <= i]
        dots = [float(qs[h, i] @ ks[h // group, j]) / math.sqrt(dim) for j in visible]
        return dict(zip(visible, _softmax(dots)))

    def top(candidates, value, count):
        return sorted(candidates, key=lambda j: value[j], reverse=True)[:count]

    for start in range(0, steps, chunk):
        new = list(range(start, min(start + chunk, steps)))
        for kv in range(num_kv_heads):
            lists[kv] += new
            for j in new:
                score[kv][j] = 0.0
            for h in range(kv * group, (kv + 1) * group):
                for i in new:
                    for j, w in weights(h, i, lists[kv]).items():
                        score[kv][j] += w
        if len(lists[0]) > budget:
            for kv in range(num_kv_heads):
                tokens = lists[kv]
                if name == "StreamingLLM":
                    keep = [j for j in tokens if j < sinks]
                    keep += tokens[len(tokens) - (budget - len(keep)) :]
                elif name == "H2O":
                    protected = tokens[len(tokens) - int(recent * budget) :]
                    others = [j for j in tokens if j not in protected]
                    keep = protected + top(others, score[kv], budget - len(protected))
                elif name == "TOVA":
                    last = new[-1]
                    mean = {j: 0.0 for j in tokens}
                    for h in range(num_heads):
                        for j, w in weights(h, last, lists[h // group]).items():
                            mean[j] += w / num_heads
                    keep = top(tokens, mean, budget)
                elif name == "SnapKV":
                    queries = list(range(max(0, new[-1] + 1 - window), new[-1] + 1))
                    votes = {j: 0.0 for j in tokens}
                    for h in range(kv * group, (kv + 1) * group):
                        for i in queries:
                            for j, w in weights(h, i, tokens).items():
                                votes[j] += w
                    half = kernel // 2
                    pooled = {
                        j: max(votes[x] for x in tokens[max(0, n - half) : n + half + 1])
                        for n, j in enumerate(tokens)
                    }
                    protected = tokens[len(tokens) - len(queries) :]
                    others = [j for j in tokens if j not in protected]
                    keep = protected + top(others, pooled, budget - len(protected))
                lists[kv] = sorted(keep)
        history.append([list(x) for x in lists])
    return history


@pytest.mark.parametrize(
    "name, policy",
    [
        ("StreamingLLM", StreamingLLM(4)),
        ("H2O", H2O(0.5)),
        ("TOVA", TOVA()),
        ("SnapKV", SnapKV(4, 3)),
    ],
)
@pytest.mark.parametrize("chunk", [1, 3])
def test_policy_keeps_what_the_brute_force_rule_keeps(name, policy, chunk):
    budget, steps = 10, 30
    cache = EvictingCache(1, policy, budget)
    kept, qs, ks = _drive(cache, steps, 4, 2, 8, seed=5, chunk=chunk)
    expected = _brute_force(name, budget, qs, ks, chunk)
    assert kept == expected
    assert all(len(heads[0]) == min(budget, (i + 1) * chunk) for i, heads in enumerate(kept))
    if name == "TOVA":  # one decision per layer
        assert all(heads[0] == heads[1] for heads in kept)


def test_h2o_normalized_divides_by_the_queries_that_saw_each_token():
    cache = EvictingCache(1, H2O(0.0, normalize=True), 6)
    _drive(cache, 6, 2, 1, 4, seed=1)  # 6 tokens, nothing evicted yet
    state = cache.layers[0]
    assert state.seen[0, 0].tolist() == [6, 5, 4, 3, 2, 1]  # token j seen by queries j .. 5
    assert torch.allclose(state.scores.sum(), torch.tensor(2 * 6.0, dtype=torch.float32))


def test_random_eviction_is_seeded_and_keeps_the_budget():
    runs = []
    for _ in range(2):
        cache = EvictingCache(1, RandomEviction(7), 5)
        runs.append(_drive(cache, 20, 2, 2, 4)[0])
    assert runs[0] == runs[1] and all(len(h[0]) <= 5 for h in runs[0])


def test_rerotation_is_not_exact_and_its_error_grows():
    """Rotate keys to position n, then move them back one position at a time (n corrections): the
    rounding of each correction accumulates, about linearly in n."""
    torch.manual_seed(0)
    k = torch.randn(1, 4, 16, 64)
    errors = {}
    for n in (1, 1000):
        keys = apply_rope(k, *rope_cos_sin(torch.full((1, 16), n), 64, 10000.0))
        for _ in range(n):
            keys = rerotate_keys(keys, -1, 64, 10000.0)
        errors[n] = float((keys - k).abs().max())
    assert 0 < errors[1] < 1e-5  # not exact, but one rounding
    assert errors[1000] > 20 * errors[1]


@pytest.mark.parametrize("causal", [True, False])
def test_token_scores_from_lse_match_the_materialised_weights(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 50, 16) for _ in range(3))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    scores = (q @ k.transpose(-1, -2)) / 4
    if causal:
        scores = scores.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), -math.inf)
    expected = scores.softmax(-1).sum(dim=2)
    got = token_scores_from_lse(q, k, lse, causal=causal, block_size=16)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="lse"):
        token_scores_from_lse(q, k, lse[:, :, :3])


def test_bad_arguments_are_named(gqa_model):
    with pytest.raises(ValueError, match="budget.*num_sinks=4"):
        EvictingCache(2, StreamingLLM(4), 4)
    with pytest.raises(ValueError, match="budget.*window=32"):
        EvictingCache(2, SnapKV(), 32)
    with pytest.raises(ValueError, match="positions"):
        EvictingCache(2, TOVA(), 8, positions="relative")
    with pytest.raises(ValueError, match="rope"):
        EvictingCache(2, TOVA(), 8, positions="cache")
    with pytest.raises(TypeError, match="policy"):
        EvictingCache(2, "h2o", 8)
    with pytest.raises(ValueError, match="recent_fraction"):
        H2O(1.0)
    with pytest.raises(ValueError, match="kernel_size"):
        SnapKV(8, 4)
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    with pytest.raises(ValueError, match="padding"):
        generate(gqa_model, ids, 2, attention_mask=mask, cache=EvictingCache.factory(TOVA(), 8))
    with pytest.raises(UnsupportedConfigError, match="MLA"):
        EvictingCache.for_model(LlamaModel(MLA), TOVA(), 8)


def test_streamed_logits_follow_the_full_forward(gqa_model):
    ids = torch.randint(0, TINY.vocab_size, (3, 20), generator=torch.Generator().manual_seed(4))
    full = streamed_logits(gqa_model, ids, None)
    for prefill, chunk in ((1, 1), (5, 4)):
        got = streamed_logits(
            gqa_model,
            ids,
            DynamicCache(TINY.num_hidden_layers),
            prefill_len=prefill,
            chunk_size=chunk,
        )
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="prefill_len"):
        streamed_logits(gqa_model, ids, DynamicCache(TINY.num_hidden_layers), prefill_len=21)


@pytest.mark.recorded
def test_recorded_sweep_spot_check_recall():
    spot_check_recall(RESULTS, "H2O", 64, eviction_factory("H2O", 64, snapkv_window=8))


@pytest.mark.recorded
@pytest.mark.slow
def test_recorded_sweep_spot_check_smollm2(smollm2):
    spot_check_smollm2(
        RESULTS,
        smollm2,
        text=("SnapKV", 128, eviction_factory("SnapKV", 128)),
        passkey=("SnapKV", 256, eviction_factory("SnapKV", 256)),
    )
