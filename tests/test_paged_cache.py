"""kvlib.cache.PagedCache: generation through it is token-identical to the dense cache (greedy,
beam search, sampling; ragged batches, chunked prefill; the course model and SmolLM2), its writes
follow the slot mapping, beams share blocks and copy on write, and running out is an error."""

import pytest
import torch

from kvlib.cache import DynamicCache, PagedCache
from kvlib.cache.paged import PagedKV, gather_kv, paged_attention
from kvlib.errors import OutOfBlocksError
from kvlib.generation import generate
from kvlib.kernels import paged_decode_attention  # imported first: it sets TRITON_INTERPRET on CPU
from kvlib.loaders.course_model import load_course_model


@pytest.fixture(scope="module")
def course_model():
    return load_course_model()


def ragged_batch(vocab, seed=0):
    """Three prompts of 37, 27 and 7 tokens, left-padded to 37."""
    ids = torch.randint(0, vocab, (3, 37), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    mask[2, :30] = 0
    return ids, mask


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_beams": 3},
        {"temperature": 1.0, "top_k": 20},
        {"temperature": 1.0, "num_samples": 3},
        {"prefill_chunk_size": 7},
    ],
    ids=["greedy", "beam", "sampling", "parallel-sampling", "chunked"],
)
def test_paged_generation_is_token_identical_to_dense(course_model, block_size, options):
    ids, mask = ragged_batch(course_model.config.vocab_size)
    outputs = []
    for cache in ("dynamic", "paged"):
        generator = torch.Generator().manual_seed(1) if "temperature" in options else None
        outputs.append(
            generate(course_model, ids, 30, attention_mask=mask, cache=cache,
                     block_size=block_size, generator=generator, **options)
        )  # fmt: skip
    assert torch.equal(*outputs)


@pytest.mark.parametrize("options", [{}, {"num_beams": 2}], ids=["greedy", "beam"])
def test_paged_generation_on_smollm2(smollm2, options):
    model, tokenizer = smollm2
    prompts = ["The key/value cache stores", "Paged attention splits the cache into blocks of"]
    encoded = [tokenizer.encode(p) for p in prompts]
    width = max(len(e) for e in encoded)
    ids = torch.tensor([[0] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    dense = generate(model, ids, 12, attention_mask=mask, **options)
    paged = generate(model, ids, 12, attention_mask=mask, cache="paged", block_size=4, **options)
    assert torch.equal(dense, paged)


def test_writes_follow_the_slot_mapping(course_model):
    cache = PagedCache.for_model(course_model, 2, 40, block_size=4)
    dense = DynamicCache(course_model.config.num_hidden_layers)
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        course_model(ids, cache=cache)
        course_model(ids, cache=dense)
    manager, layer = cache.manager, 2
    for b in range(2):
        for t in range(11):
            slot = manager.block_tables[b][t // 4] * 4 + t % 4
            assert slot == manager.slot(b, t)
            stored = cache.key_cache[layer].flatten(0, 1)[slot]  # (H_kv, D)
            assert torch.equal(stored, dense.keys[layer][b, :, t])
    tables = torch.tensor([manager.block_tables[b] for b in range(2)])
    lens = torch.tensor([11, 11])
    handle = PagedKV(cache.key_cache[layer], cache.value_cache[layer], tables, lens)
    k, v = gather_kv(handle)  # the read path: logical order again
    assert torch.equal(k, dense.keys[layer]) and torch.equal(v, dense.values[layer])
    with pytest.raises(ValueError, match="a step starts at layer 0"):
        cache.update(layer, k[:, :, :1], v[:, :, :1])


def test_beams_share_the_prompt_blocks_and_copy_on_write(course_model):
    c = course_model.config
    cache = PagedCache.for_model(course_model, 4, 64, block_size=8)
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        course_model(ids, cache=cache)
        prompt_blocks = cache.num_blocks_in_use  # ceil(20 / 8) = 3
        beams = cache.repeat(4)
        assert beams.num_blocks_in_use == prompt_blocks == 3  # shared, not copied
        assert cache.num_blocks_in_use == 0  # the sequences moved to the copy
        course_model(torch.tensor([[1], [2], [3], [4]]), cache=beams)
    # each beam wrote into the shared, partly filled third block: three copied it, one kept it
    assert beams.num_blocks_in_use == 3 + 3
    beams.manager.check_invariants()
    per_block = 2 * c.num_hidden_layers * 8 * c.num_key_value_heads * c.head_dim * 4
    assert beams.nbytes == 6 * per_block


def test_running_out_of_blocks_raises(course_model):
    cache = PagedCache(4, 4, 32, num_blocks=2, block_size=4)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        course_model(ids, cache=cache)  # 8 tokens: both blocks
        with pytest.raises(OutOfBlocksError, match="1 blocks needed, 0 of 2 free"):
            course_model(ids[:, :1], cache=cache)
    with pytest.raises(ValueError, match="MLA model caches latent rows"):
        from kvlib.loaders.course_model import load_course_mla_model

        PagedCache.for_model(load_course_mla_model(), 1, 8)


def test_padding_is_not_stored_and_chapter_11s_kernel_reads_the_same_layout(course_model):
    ids, mask = ragged_batch(course_model.config.vocab_size)  # 37, 27 and 7 real tokens
    c = course_model.config
    cache = PagedCache.for_model(course_model, 3, 64, block_size=4)
    with torch.no_grad():
        course_model(ids, cache=cache, attention_mask=mask)
    assert cache.seq_lens.tolist() == [37, 27, 7] and cache.length == 37
    assert cache.num_blocks_in_use == 10 + 7 + 2  # ceil(n / 4) each: no block holds padding
    layer = 1
    tables = torch.tensor(
        [cache.manager.block_tables[b] + [0] * (10 - len(cache.manager.block_tables[b]))
         for b in range(3)]
    )  # fmt: skip
    handle = PagedKV(cache.key_cache[layer], cache.value_cache[layer], tables, cache.seq_lens)
    q = torch.randn(
        3, c.num_attention_heads, 1, c.head_dim, generator=torch.Generator().manual_seed(4)
    )
    held = torch.arange(37)[None, None, :] < cache.seq_lens[:, None, None]  # (B, 1, S)
    torch_out = paged_attention(q, handle, held)[:, :, 0]
    kernel_out = paged_decode_attention(
        q[:, :, 0], handle.key_cache, handle.value_cache, tables.int(), cache.seq_lens.int()
    )
    torch.testing.assert_close(kernel_out, torch_out, rtol=1e-5, atol=1e-5)
