"""The ring-buffer cache of a sliding-window layer (`kvlib.cache.ring`, chapter 17) against its
oracle, the full forward with the window mask (`kvlib.model.attention_mask_3d`): logits equal
across chunk sizes below, at and above the window and across wrap-arounds, greedy generation token
for token, the update at exactly the window length (transformers #37574), slots = position mod W,
and memory that stops growing.

The course model was trained without a window; a copy of its config with `sliding_window` set
gives a model whose outputs depend on the window (checked), which is all an equality test needs.

Tolerances: in float32 the ring and the oracle add the same non-zero terms, but over different
numbers of keys (n + T held vs length + T, the masked ones contributing exact zeros), so BLAS may
block the sums differently: round-off of order 1e-5 on logits of order 10; we allow
atol = rtol = 1e-4. In float64 the same comparison holds to 1e-10.
"""

import dataclasses

import pytest
import torch

from kvlib.cache import DynamicCache
from kvlib.cache.ring import RingCache, RingKV, ring_attention
from kvlib.generation import generate
from kvlib.loaders.course_model import load_course_model
from kvlib.model import LlamaModel
from kvlib.testing import assert_close

W = 8  # the window: small, so that 41 tokens wrap the ring five times
NUM_TOKENS = 41
FLOAT32 = {"rtol": 1e-4, "atol": 1e-4}
CHUNKS = (1, 3, W - 1, W, W + 1, 2 * W + 3)


@pytest.fixture(scope="module")
def windowed():
    """The course model with `sliding_window = W` on a copy of its config (read only)."""
    base = load_course_model()
    model = LlamaModel(dataclasses.replace(base.config, sliding_window=W)).eval()
    model.load_state_dict(base.state_dict())
    return model


def token_ids(batch: int = 2, length: int = NUM_TOKENS, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def chunked(model, ids: torch.Tensor, cache, chunk: int) -> tuple[torch.Tensor, list[int]]:
    """Logits (B, T, V) of `ids` fed in chunks of `chunk` tokens, and the cache's nbytes after
    each chunk."""
    logits, sizes = [], []
    for start in range(0, ids.shape[1], chunk):
        logits.append(model(ids[:, start : start + chunk], cache=cache))
        sizes.append(cache.nbytes)
    return torch.cat(logits, dim=1), sizes


@pytest.mark.parametrize("chunk", CHUNKS)
@torch.no_grad()
def test_ring_logits_equal_the_window_masked_full_forward(windowed, chunk):
    ids = token_ids()
    oracle = windowed(ids)  # (B, T, V): the model's own window mask, no cache
    ring_logits, sizes = chunked(windowed, ids, RingCache.for_model(windowed), chunk)
    assert_close(ring_logits, oracle, name=f"ring logits, chunks of {chunk}", **FLOAT32)
    dense_logits, _ = chunked(windowed, ids, DynamicCache(4), chunk)
    assert_close(ring_logits, dense_logits, name="ring vs dense cache", **FLOAT32)
    c = windowed.config
    fixed = 2 * c.num_hidden_layers * 2 * c.num_key_value_heads * W * c.head_dim * 4  # float32
    assert sizes == [fixed] * len(sizes), f"nbytes not flat at {fixed}: {sizes}"


@torch.no_grad()
def test_the_window_changes_the_outputs_so_the_equality_is_not_vacuous(windowed):
    ids = token_ids()
    unwindowed = load_course_model()
    difference = (windowed(ids) - unwindowed(ids)).abs().amax(dim=(0, 2))  # (T,)
    assert difference[:W].max() < 1e-4, "positions inside the first window see the same keys"
    assert difference[W:].min() > 1e-2, f"the window made no difference: {difference[W:].min()}"


@pytest.mark.parametrize("chunk", (1, W + 1, 2 * W + 3))
@torch.no_grad()
def test_ring_equals_the_oracle_to_round_off_in_float64(windowed, chunk):
    model = LlamaModel(windowed.config).double().eval()
    model.load_state_dict(windowed.state_dict())
    ids = token_ids(seed=1)
    ring_logits, _ = chunked(model, ids, RingCache.for_model(model), chunk)
    assert_close(ring_logits, model(ids), name="float64 ring logits", rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("prefill_chunk_size", (None, 3, W, 2 * W + 3))
def test_greedy_generation_is_token_for_token_the_dense_caches(windowed, prefill_chunk_size):
    prompts = token_ids(length=2 * W + 5, seed=2)
    kwargs = {"max_new_tokens": 3 * W, "prefill_chunk_size": prefill_chunk_size}
    dense = generate(windowed, prompts, cache="dynamic", **kwargs)
    ring = generate(
        windowed, prompts, cache=lambda model, b, s: RingCache.for_model(model), **kwargs
    )
    assert torch.equal(ring, dense), f"first difference at {(ring != dense).nonzero()[:1]}"
    naive = generate(windowed, prompts, use_cache=False, **kwargs)
    assert torch.equal(ring, naive)


class EarlyRollingRing(RingCache):
    """The bug of transformers #37574 (SlidingWindowCache, 2025): the cache rolled as soon as the
    length REACHED the window instead of when it passed it, so the query at position W - 1 and
    every later one lost the oldest key still inside its window (here: one position too few)."""

    @property
    def held(self) -> int:
        return min(self.length, self.window - 2)


@pytest.mark.parametrize("prompt_length", (W - 1, W, W + 1))
@torch.no_grad()
def test_the_update_at_exactly_the_window_length(windowed, prompt_length):
    """Prefill W - 1, W or W + 1 tokens, then decode one at a time across the boundary: each
    step's logits equal the full forward's, and the slots hold what position mod W says."""
    ids = token_ids(length=prompt_length + 4, seed=3)
    oracle = windowed(ids)  # (B, T, V)
    ring, buggy = RingCache.for_model(windowed), EarlyRollingRing(4, W)
    logits = windowed(ids[:, :prompt_length], cache=ring)
    buggy_logits = windowed(ids[:, :prompt_length], cache=buggy)
    assert_close(logits, oracle[:, :prompt_length], name="prefill", **FLOAT32)
    for position in range(prompt_length, ids.shape[1]):
        step = windowed(ids[:, position : position + 1], cache=ring)[:, 0]
        assert_close(step, oracle[:, position], name=f"decode at position {position}", **FLOAT32)
        buggy_step = windowed(ids[:, position : position + 1], cache=buggy)[:, 0]
        if position >= W - 1:  # from the step that reaches the window on, the bug shows
            assert (buggy_step - oracle[:, position]).abs().max() > 1e-3, position
    assert prompt_length >= W or (buggy_logits - oracle[:, :prompt_length]).abs().max() < 1e-4


def test_slot_of_position_p_is_p_mod_w_across_wraps():
    """Keys and values equal to their position: after each write, slot p % W holds p for the
    last min(length, W) positions, whatever the chunk sizes (larger than W included)."""
    ring = RingCache(2, W)
    length = 0
    for chunk in (3, 1, W - 1, 1, W, W + 1, 2 * W + 3, 1, 1):
        positions = torch.arange(length, length + chunk, dtype=torch.float64)
        k = positions.view(1, 1, chunk, 1).expand(2, 3, chunk, 4).contiguous()  # (B, H_kv, T, D)
        for layer in range(2):
            kv = ring.update(layer, k + layer, -k)
            assert isinstance(kv, RingKV)
            held_before = min(length, W)
            expected = torch.arange(length - held_before, length + chunk)
            assert torch.equal(kv.key_positions, expected)
            assert torch.equal(kv.keys[0, 0, :, 0], expected.double() + layer)
        ring.advance(chunk)
        length += chunk
        for p in range(max(0, length - W), length):
            assert ring.keys[1][0, 2, p % W, 3] == p + 1 and ring.values[0][1, 0, p % W, 0] == -p
    assert ring.held == W and ring.length == length


@torch.no_grad()
def test_memory_is_flat_while_a_dense_cache_grows(windowed):
    ids = token_ids(length=4 * W)
    ring, dense = RingCache.for_model(windowed), DynamicCache(4)
    _, ring_sizes = chunked(windowed, ids, ring, 1)
    _, dense_sizes = chunked(windowed, ids, dense, 1)
    assert len(set(ring_sizes)) == 1 and ring_sizes[0] == dense_sizes[W - 1]
    assert dense_sizes[-1] == 4 * ring_sizes[-1]


@torch.no_grad()
def test_repeat_and_reorder_follow_their_sequences(windowed):
    ids = token_ids(batch=2, length=W + 3, seed=4)
    ring = RingCache.for_model(windowed)
    windowed(ids, cache=ring)
    copies = ring.repeat(2)  # sequences 0, 0, 1, 1
    copies.reorder(torch.tensor([3, 0]))  # sequence 1, then sequence 0
    nxt = token_ids(batch=2, length=W + 2, seed=5)
    swapped = torch.stack([nxt[1], nxt[0]])
    out = windowed(swapped, cache=copies)
    oracle = windowed(torch.cat([ids.flip(0), swapped], dim=1))[:, ids.shape[1] :]
    assert_close(out, oracle, name="repeated and reordered ring", **FLOAT32)
    assert copies.seq_lens.tolist() == [2 * W + 5] * 2


def test_refusals_name_the_argument(windowed):
    with pytest.raises(ValueError, match="window: expected an int >= 1, got 0"):
        RingCache(4, 0)
    with pytest.raises(ValueError, match="window: expected the model's sliding_window 8, got 5"):
        RingCache.for_model(windowed, 5)
    with pytest.raises(ValueError, match="window: expected an int"):
        RingCache.for_model(load_course_model())
    ring = RingCache.for_model(windowed)
    padded = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="attention_mask: RingCache does not support padding"):
        windowed(token_ids(length=3), cache=ring, attention_mask=padded)
    with pytest.raises(ValueError, match="layer_idx"):
        ring.update(4, torch.zeros(1, 4, 1, 32), torch.zeros(1, 4, 1, 32))
    with pytest.raises(NotImplementedError, match="RingCache does not roll back: once the ring"):
        ring.truncate(0)
    kv = RingCache(1, W).update(0, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    wrong_mask = torch.ones(1, 2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask: expected 2 keys"):
        ring_attention(torch.zeros(1, 1, 2, 4), kv, wrong_mask)
