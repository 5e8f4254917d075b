"""kvlib.cache.evicting_margin: an evicting cache that rolls back within a margin. A forward of T
tokens after the prefill is T decode steps, bitwise those of `EvictingCache` fed one token per
forward; a rollback within the margin leaves bitwise the cache that never saw the rolled-back
tokens (K/V, positions, scores, query counts, SnapKV's window, the eviction count), and greedy
speculation over it emits the tokens plain greedy decoding emits over `EvictingCache`."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import data
from kvlib.cache.evicting import EvictingCache
from kvlib.cache.evicting_margin import MarginEvictingCache
from kvlib.cache.eviction_policies import H2O, TOVA, RandomEviction, SnapKV, StreamingLLM
from kvlib.generation import generate
from kvlib.loaders.course_model import load_course_model
from kvlib.speculative import speculative_generate

LAYERS, BATCH, HEADS, GROUP, DIM, BUDGET = 2, 2, 2, 2, 8, 10
ROPE = (DIM, 10000.0, None)
POLICIES = {
    "StreamingLLM": lambda: StreamingLLM(2),
    "H2O": lambda: H2O(),
    "H2O normalized": lambda: H2O(normalize=True),
    "TOVA": lambda: TOVA(),
    "SnapKV": lambda: SnapKV(window=4, kernel_size=3),
}


def qkv(num_tokens: int, seed: int = 0, batch: int = BATCH):
    """Queries (B, H, N, D) and per-layer keys and values (L, B, H_kv, N, D) of N tokens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS * GROUP, num_tokens, DIM, generator=g)
    k = torch.randn(LAYERS, batch, HEADS, num_tokens, DIM, generator=g)
    v = torch.randn(LAYERS, batch, HEADS, num_tokens, DIM, generator=g)
    return q, k, v


def feed(cache, tensors, start: int, stop: int) -> torch.Tensor:
    """One forward of tokens start..stop-1 through every layer, as the model calls the cache;
    returns the last layer's attention output (B, H, T, D)."""
    q, k, v = tensors
    cache.begin_forward(stop - start, None)
    for layer in range(LAYERS):
        handle = cache.update(layer, k[layer][:, :, start:stop], v[layer][:, :, start:stop])
        out = cache.attention_backend(q[:, :, start:stop] + layer, handle)
    cache.advance(stop - start)
    return out


def contents(cache) -> list[torch.Tensor]:
    """Everything a later step reads or a policy decides from."""
    out = []
    for s in cache.layers:
        out += [s.keys, s.values, s.positions, s.scores, s.seen]
        out += [] if s.queries is None else [s.queries]
    return out + [torch.tensor([cache.length, cache.evicted])]


def assert_bitwise(a, b, what: str) -> None:
    x, y = contents(a), contents(b)
    assert len(x) == len(y), what
    for i, (p, q) in enumerate(zip(x, y)):
        assert p.shape == q.shape and torch.equal(p, q), f"{what}: tensor {i} differs"


def make(name: str, positions: str, margin: int | None):
    """`EvictingCache` (margin None) or `MarginEvictingCache` with policy `name`."""
    options = dict(positions=positions, rope=ROPE)
    if margin is None:
        return EvictingCache(LAYERS, POLICIES[name](), BUDGET, **options)
    return MarginEvictingCache(LAYERS, POLICIES[name](), BUDGET, rollback_margin=margin, **options)


@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_chunk_is_decode_steps_and_a_rollback_is_bitwise_never_seen(name, positions):
    """Prefill 12 tokens (over the budget of 10), then verification chunks of up to 5 tokens
    rolled back to the accepted ones, against `EvictingCache` fed the accepted tokens one by one:
    equal after every step, and the chunk's attention outputs equal the single steps' too."""
    tensors = qkv(40)
    plain, margin = make(name, positions, None), make(name, positions, 5)
    feed(plain, tensors, 0, 12)
    feed(margin, tensors, 0, 12)
    assert_bitwise(plain, margin, "after the prefill")
    position = 12
    for chunk, accepted in [(5, 2), (3, 3), (5, 0), (4, 4), (2, 1), (5, 5), (1, 0)]:
        out = feed(margin, tensors, position, position + chunk)
        margin.truncate(position + accepted)
        for t in range(position, position + accepted):
            step = feed(plain, tensors, t, t + 1)
            assert torch.equal(step, out[:, :, t - position : t - position + 1])
        assert_bitwise(plain, margin, f"chunk {chunk}, {accepted} kept")
        position += accepted


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(POLICIES)),
    prompt=st.integers(1, 14),
    steps=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=6),
)
def test_rollback_within_the_margin_is_exact_for_any_chunks(name, prompt, steps):
    """Random prompt lengths (under and over the budget), chunk sizes and accepted counts, margin
    4: the rolled-back cache equals bitwise a cache fed only the kept tokens, a chunk at a time."""
    tensors = qkv(prompt + 4 * len(steps), seed=prompt)
    rolled, kept = make(name, "original", 4), make(name, "original", 4)
    feed(rolled, tensors, 0, prompt)
    feed(kept, tensors, 0, prompt)
    position = prompt
    for chunk, accepted in steps:
        accepted = min(accepted, chunk)
        feed(rolled, tensors, position, position + chunk)
        rolled.truncate(position + accepted)
        if accepted:
            feed(kept, tensors, position, position + accepted)
        position += accepted
        assert_bitwise(rolled, kept, f"after {steps}")


def test_the_margin_costs_memory_not_behaviour():
    """Margins 0, 3 and 8 decode an 18-token chunk as `EvictingCache` does one token at a time;
    only the undo records differ, a margin's worth: per step and layer, one evicted token's K/V,
    position and index (a decode step evicts one token once the budget is full) and the score
    and count rows of the budget's tokens before it."""
    tensors = qkv(30)
    reference = make("H2O", "original", None)
    feed(reference, tensors, 0, 12)
    for t in range(12, 30):
        feed(reference, tensors, t, t + 1)
    for margin in (0, 3, 8):
        cache = make("H2O", "original", margin)
        feed(cache, tensors, 0, 12)
        feed(cache, tensors, 12, 30)
        assert_bitwise(reference, cache, f"margin {margin}")
        kv_row = 2 * DIM * 4 + 8 + 8  # K and V in float32, an int64 position and index
        score_rows = BUDGET * (4 + 8)  # a float32 score and an int64 count per held token
        per_step = BATCH * HEADS * (kv_row + score_rows) * LAYERS
        assert cache.rollback_nbytes == margin * per_step
        assert cache.rollback_floor == 30 - margin


def test_a_rollback_beyond_the_margin_or_into_the_prefill_says_why():
    tensors = qkv(20)
    cache = make("StreamingLLM", "original", 2)
    feed(cache, tensors, 0, 12)
    feed(cache, tensors, 12, 15)
    with pytest.raises(
        ValueError, match=r"12 is beyond rollback_margin = 2: .* to lengths 13\.\.15 only"
    ):
        cache.truncate(12)
    cache.truncate(14)  # within it, and again
    cache.truncate(13)
    with pytest.raises(ValueError, match="length: 12 is beyond rollback_margin = 2"):
        cache.truncate(12)  # the margin counts from the latest forward's end
    with pytest.raises(ValueError, match="length: expected an int in"):
        cache.truncate(14)  # not a rollback
    short = make("StreamingLLM", "original", 8)
    feed(short, tensors, 0, 12)
    feed(short, tensors, 12, 14)
    with pytest.raises(ValueError, match="inside the first forward's 12 tokens"):
        short.truncate(11)
    short.truncate(0)  # a cache as new
    assert short.length == short.evicted == 0 and short.layers == [None] * LAYERS
    feed(short, tensors, 0, 12)
    fresh = make("StreamingLLM", "original", 8)
    feed(fresh, tensors, 0, 12)
    assert_bitwise(short, fresh, "refilled after truncate(0)")
    none = make("StreamingLLM", "original", 0)
    feed(none, tensors, 0, 12)
    feed(none, tensors, 12, 13)
    with pytest.raises(ValueError, match="beyond rollback_margin = 0"):
        none.truncate(12)


def test_what_the_margin_cannot_do_is_refused_by_name():
    with pytest.raises(ValueError, match="rollback_margin: RandomEviction draws from a generator"):
        MarginEvictingCache(LAYERS, RandomEviction(0), BUDGET, rollback_margin=1)
    MarginEvictingCache(LAYERS, RandomEviction(0), BUDGET)  # margin 0: nothing to undo
    with pytest.raises(ValueError, match="rollback_margin: expected an int >= 0, got -1"):
        MarginEvictingCache(LAYERS, H2O(), BUDGET, rollback_margin=-1)
    with pytest.raises(NotImplementedError, match="does not move tokens"):
        MarginEvictingCache(LAYERS, H2O(), BUDGET, rollback_margin=2).move_tokens([1], [0])


def test_a_repeated_batch_rolls_back_each_copy():
    """repeat(2) after a chunk: the undo records are copied with the sequences; rolling back the
    copies equals rolling back the original."""
    tensors = qkv(20, batch=1)
    cache = make("H2O", "original", 4)
    feed(cache, tensors, 0, 12)
    feed(cache, tensors, 12, 16)
    copies = cache.repeat(2)
    cache.truncate(13)
    copies.truncate(13)
    for a, b in zip(contents(cache)[:-1], contents(copies)[:-1]):
        assert torch.equal(a.repeat_interleave(2, dim=0), b)


@pytest.fixture(scope="module")
def course_model():
    return load_course_model()


MODEL_POLICIES = {  # name: (policy, positions)
    "StreamingLLM": (lambda: StreamingLLM(4), "cache"),
    "H2O": (lambda: H2O(), "original"),
    "TOVA": (lambda: TOVA(), "original"),
    "SnapKV": (lambda: SnapKV(window=8), "original"),
}


@pytest.mark.parametrize("name", sorted(MODEL_POLICIES))
def test_greedy_speculation_over_a_margin_emits_plain_greedy_tokens_over_evicting_cache(
    course_model, name
):
    """Prompt lookup at k = 4 over a margin of 4, and a drafter that is mostly wrong (most
    verifications roll back all 4): the tokens `generate` emits over `EvictingCache` (budget 32,
    a 64-token prompt, 40 new tokens)."""
    model, (policy, positions) = course_model, MODEL_POLICIES[name]
    prompt = torch.from_numpy(data.recall_documents(32, 1)[0].tokens[:64])[None]
    plain = generate(
        model, prompt, 40, cache=EvictingCache.factory(policy(), 32, positions=positions)
    )
    vocab = model.config.vocab_size

    def wrong(tokens, k):  # mostly not the target's token: the last token + 1, k times
        return [(tokens[-1] + 1) % vocab] * k

    for drafter in (None, wrong):
        cache = MarginEvictingCache.for_model(
            model, policy(), 32, rollback_margin=4, positions=positions
        )
        options = {} if drafter is None else {"drafter": drafter}
        tokens, stats = speculative_generate(model, prompt, cache, max_new_tokens=40, **options)
        assert torch.equal(tokens, plain), (name, drafter)
        assert cache.length == 64 + 39 and cache.seq_lens.tolist() == [32]
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_margin_below_k_is_refused_mid_speculation(course_model):
    prompt = torch.from_numpy(data.recall_documents(32, 1)[0].tokens[:64])[None]
    cache = MarginEvictingCache.for_model(course_model, H2O(), 32, rollback_margin=1)
    with pytest.raises(ValueError, match="beyond rollback_margin = 1"):
        speculative_generate(
            course_model, prompt, cache, max_new_tokens=20, k=4, drafter=lambda t, k: [0] * k
        )
