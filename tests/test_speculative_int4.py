"""kvlib.speculative.quant_draft: the target drafting over an int4 copy of its own cache
(QuantSpec) emits plain greedy's tokens; the copy holds exactly the target's accepted tokens,
quantized from the target's own K/V, and drafting leaves both caches as they were."""

import pytest
import torch

from kvlib import data
from kvlib.cache import DynamicCache, StaticCache
from kvlib.cache.quantized import QuantizedCache
from kvlib.generation import generate
from kvlib.loaders.course_model import load_course_model
from kvlib.quant import QuantScheme
from kvlib.sparse import SparsePagedCache
from kvlib.speculative import Draft, QuantizedSelfDrafter, speculative_generate
from kvlib.speculative.quant_draft import INT4_KIVI

INT4_PER_TOKEN = QuantScheme("int4", symmetric=False, reduce="channels")


@pytest.fixture(scope="module")
def course_model():
    return load_course_model()


def prompt(index: int = 0, length: int = 96) -> torch.Tensor:
    return torch.from_numpy(data.recall_documents(32, index + 1)[index].tokens[:length])[None]


@pytest.mark.parametrize(
    ("kind", "schemes", "residual", "k"),
    [
        ("dynamic", {}, 0, 2),  # int4 KIVI: keys per channel in groups of 32 tokens
        ("dynamic", {}, 8, 4),  # a full-precision residual of 8 tokens
        ("static", {"key_scheme": INT4_PER_TOKEN}, 0, 4),  # every token's K and V in int4
    ],
    ids=["kivi-dynamic-k2", "kivi-residual8-k4", "per-token-static-k4"],
)
def test_int4_self_speculation_emits_plain_greedy_tokens(course_model, kind, schemes, residual, k):
    """96-token prompt, 40 new tokens: the tokens of `generate`; the int4 copy ends holding the
    target's tokens; most guesses stand (the int4 view is close to the full cache)."""
    model, ids = course_model, prompt()
    plain = generate(model, ids, 40)
    cache = DynamicCache(4) if kind == "dynamic" else StaticCache.for_model(model, 1, 96 + 40)
    drafter = QuantizedSelfDrafter(model, cache, **schemes, residual_length=residual)
    tokens, stats = speculative_generate(model, ids, cache, max_new_tokens=40, k=k, drafter=drafter)
    assert torch.equal(tokens, plain)
    assert drafter.quantized.length <= cache.length == 96 + 39
    assert stats.num_accepted_tokens > stats.num_draft_tokens / 2


def test_the_copy_is_the_targets_kv_quantized_and_drafting_changes_nothing(course_model):
    """After a run, one more catch-up: the copy equals bitwise a `QuantizedCache` fed the
    target's K/V in one write (KIVI's flush points depend on the length only); a drafter call
    leaves the target and the copy bitwise as they were."""
    model, ids = course_model, prompt(1)
    cache = DynamicCache(4)
    drafter = QuantizedSelfDrafter(model, cache)
    speculative_generate(model, ids, cache, max_new_tokens=24, k=3, drafter=drafter)
    assert drafter.catch_up() >= 1 and drafter.quantized.length == cache.length
    direct = QuantizedCache(4, *INT4_KIVI)
    for layer in range(4):
        direct.update(layer, cache.keys[layer], cache.values[layer])
    direct.advance(cache.length)

    def tensors(c):
        out = [c.keys[0].codes, c.keys[0].scale, c.values[0].codes, c.residual_keys[0]]
        return out + [c.residual_values[0], torch.tensor(c.length)]

    for a, b in zip(tensors(drafter.quantized), tensors(direct)):
        assert a.shape == b.shape and torch.equal(a, b)
    before = [t.clone() for t in tensors(drafter.quantized) + cache.keys + cache.values]
    draft = drafter([int(ids[0, -1])], 4)
    assert len(draft) == 4
    after = tensors(drafter.quantized) + cache.keys + cache.values
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_sampled_drafts_carry_their_distributions(course_model):
    """At temperature 0.8 the drafter returns a `Draft` whose rows are the distributions its
    tokens were drawn from, and speculative sampling over it runs to the end (the distribution
    the rule keeps is tested in test_speculative.py)."""
    model, ids = course_model, prompt(2, 40)
    cache = DynamicCache(4)
    with torch.no_grad():
        model(ids, cache=cache)
    drafter = QuantizedSelfDrafter(
        model, cache, temperature=0.8, generator=torch.Generator().manual_seed(0)
    )
    draft = drafter(ids[0].tolist(), 3)
    assert isinstance(draft, Draft) and draft.probs.shape == (3, model.config.vocab_size)
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3, dtype=torch.float64))
    cache = DynamicCache(4)
    sampler = QuantizedSelfDrafter(
        model, cache, temperature=0.8, generator=torch.Generator().manual_seed(1)
    )
    tokens, stats = speculative_generate(
        model,
        ids,
        cache,
        max_new_tokens=12,
        k=3,
        drafter=sampler,
        temperature=0.8,
        generator=torch.Generator().manual_seed(2),
    )
    assert tokens.shape == (1, 52) and cache.length == 51 and stats.num_emitted_tokens == 11


def test_the_int4_drafter_refuses_what_it_cannot_copy(course_model):
    paged = SparsePagedCache.for_model(course_model, 1, 64, block_size=4)
    with pytest.raises(TypeError, match="cache: expected a DynamicCache or StaticCache"):
        QuantizedSelfDrafter(course_model, paged)
    with pytest.raises(ValueError, match="temperature: expected a number >= 0"):
        QuantizedSelfDrafter(course_model, DynamicCache(4), temperature=-1.0)
    with pytest.raises(ValueError, match="residual_length"):
        QuantizedSelfDrafter(course_model, DynamicCache(4), residual_length=-1)
