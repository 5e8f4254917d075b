"""Cross-layer KV sharing (`kvlib.cache.shared.CrossLayerCache`, chapter 17): the sharing layers
store nothing and read their producer's K/V of the same forward; the bytes equal chapter 3's
equation for the same `num_kv_shared_layers`; chunked forwards equal one forward; rollback,
repeat and reorder act on the producers' cache; bad mappings are refused by name."""

import pytest
import torch

from kvlib import memory as M
from kvlib.cache import DynamicCache, StaticCache
from kvlib.cache.shared import CrossLayerCache, reads_from_specs
from kvlib.loaders.course_model import load_course_model


@pytest.fixture(scope="module")
def model():
    return load_course_model()


def shared_config(model, shared):
    return model.config.to_hf() | {"num_kv_shared_layers": shared}


def shared_cache(model, shared, inner=None):
    reads = reads_from_specs(M.layer_specs(shared_config(model, shared)))
    inner = DynamicCache(4 - len(reads)) if inner is None else inner
    return CrossLayerCache(inner, 4, reads)


def tokens(batch, length, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_reads_follow_the_accounting():
    """Gemma 3n: each sharing layer reads the last earlier layer of its own kind."""
    config = M.shipped_configs()["gemma-3n-e4b"]
    specs = M.layer_specs(config)
    reads = reads_from_specs(specs)
    assert len(reads) == config["num_kv_shared_layers"]
    unshared = M.layer_specs({k: v for k, v in config.items() if k != "num_kv_shared_layers"})
    for consumer, producer in reads.items():
        assert producer < consumer and producer not in reads
        assert unshared[producer].kind == unshared[consumer].kind
        later = [s.index for s in unshared[producer + 1 : consumer] if s.index not in reads]
        assert all(unshared[i].kind != unshared[consumer].kind for i in later)
    assert all(s.reads is None for s in specs if s.kind != "shared")


@pytest.mark.parametrize("shared", [1, 2, 3])
def test_bytes_equal_the_equation(model, shared):
    for batch, length in ((1, 1), (2, 9), (3, 40)):
        cache = shared_cache(model, shared)
        with torch.no_grad():
            model(tokens(batch, length), cache=cache)
        expected = M.kv_cache_bytes(shared_config(model, shared), length, batch_size=batch)
        assert cache.nbytes == expected
        unshared = M.kv_cache_bytes(model.config.to_hf(), length, batch_size=batch)
        assert cache.nbytes * 4 == unshared * (4 - shared)  # only the producers store


@pytest.mark.parametrize("shared", [1, 2, 3])
@pytest.mark.parametrize("chunks", [(1,) * 12, (5, 1, 6), (3, 9)])
def test_chunks_equal_one_forward(model, shared, chunks):
    ids = tokens(2, 12, seed=shared)
    with torch.no_grad():
        whole = model(ids, cache=shared_cache(model, shared))
        cache, parts, start = shared_cache(model, shared), [], 0
        for n in chunks:
            parts.append(model(ids[:, start : start + n], cache=cache))
            start += n
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-4, rtol=1e-4)


def test_sharing_changes_an_untrained_model_and_no_sharing_changes_nothing(model):
    """The consumers really read the producer (outputs move); a mapping with no sharing layer is
    the plain model, bitwise."""
    ids = tokens(2, 10)
    with torch.no_grad():
        plain = model(ids, cache=DynamicCache(4))
        assert torch.equal(model(ids, cache=CrossLayerCache(DynamicCache(4), 4, {})), plain)
        assert (model(ids, cache=shared_cache(model, 2)) - plain).abs().max() > 0.1


def test_a_static_inner_cache(model):
    ids = tokens(2, 11)
    with torch.no_grad():
        dense = model(ids, cache=shared_cache(model, 2))
        inner = StaticCache(2, 2, 4, 16, 32)
        static = model(ids, cache=shared_cache(model, 2, inner))
    torch.testing.assert_close(static, dense, atol=1e-5, rtol=1e-5)


def test_truncate_repeat_reorder(model):
    ids = tokens(2, 14)
    with torch.no_grad():
        rolled = shared_cache(model, 2)
        model(ids[:, :10], cache=rolled)
        rolled.truncate(6)
        assert rolled.length == 6
        after_rollback = model(ids[:, 6:14], cache=rolled)
        fresh = shared_cache(model, 2)
        model(ids[:, :6], cache=fresh)
        torch.testing.assert_close(
            after_rollback, model(ids[:, 6:14], cache=fresh), atol=1e-5, rtol=1e-5
        )
        one = shared_cache(model, 2)
        model(ids[:1, :5], cache=one)
        copies = one.repeat(3)
        assert copies.seq_lens.tolist() == [5, 5, 5] and one.seq_lens.tolist() == [5]
        step = model(ids[:1, 5:6].expand(3, 1), cache=copies)
        torch.testing.assert_close(step[0], step[2])
        copies.reorder(torch.tensor([2, 0]))
        assert copies.seq_lens.tolist() == [6, 6]


@pytest.mark.parametrize(
    ("reads", "inner_layers", "message"),
    [
        ({2: 3}, 3, "must read an earlier layer"),
        ({2: 2}, 3, "must read an earlier layer"),
        ({4: 1}, 3, r"consumer layers must be in \[0, 4\)"),
        ({2: 1, 3: 2}, 2, "which stores nothing itself"),
        ({3: 1}, 4, r"needs one layer per producer \(3 of 4\)"),
        ({3: "1"}, 3, "must read an earlier layer"),
        ({3: True}, 3, "must read an earlier layer"),
        ({True: 0}, 3, r"consumer layers must be in \[0, 4\)"),
    ],
)
def test_bad_mappings_are_refused(reads, inner_layers, message):
    with pytest.raises(ValueError, match=message):
        CrossLayerCache(DynamicCache(inner_layers), 4, reads)


def test_a_consumer_before_its_producer_is_refused():
    cache = CrossLayerCache(DynamicCache(3), 4, {3: 1})
    k = v = torch.zeros(1, 4, 2, 32)
    cache.update(0, k, v)
    with pytest.raises(RuntimeError, match="reads layer 1's K/V, which has not been written"):
        cache.update(3, k, v)
    cache.update(1, k, v)
    assert cache.update(3, k, v)[0] is cache.update(3, k, v)[0]
    with pytest.raises(ValueError, match=r"layer_idx: must be in \[0, 4\)"):
        cache.update(7, k, v)


def test_a_cache_that_decides_positions_is_refused():
    from kvlib.cache import EvictingCache
    from kvlib.cache.eviction_policies import StreamingLLM

    inner = EvictingCache(3, StreamingLLM(num_sinks=2), budget=8)
    with pytest.raises(ValueError, match="inner: a cache that defines query_positions"):
        CrossLayerCache(inner, 4, {3: 1})
