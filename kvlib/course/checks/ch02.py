"""Chapter 2's graded questions: RoPE at an offset, the static cache's insert, reordering caches for
beams. Oracles: kvlib.model / kvlib.cache, imported before the grader blocks them."""

from __future__ import annotations

import torch

from kvlib.course.grading import ROPE_API, LearnerRaised, Submission, question
from kvlib.layers.llama import apply_rope, rope_cos_sin
from kvlib.testing import assert_close


@question(function="rope_at_offset", blocked=ROPE_API)
def test_rope_at_offset(submission: Submission) -> None:
    rope_at_offset = submission.function("rope_at_offset")
    generator, drawn = torch.Generator().manual_seed(2), submission.rng()
    cases = [(1, 8, 0, 10000.0), (5, 16, 37, 10000.0), (3, 8, 1000, 500000.0)]
    cases += [  # drawn per run (seeded from the answer's source)
        (int(drawn.integers(1, 7)), 2 * int(drawn.integers(1, 17)), int(drawn.integers(0, 5000)),
         float(drawn.choice([10000.0, 500000.0, 1e6])))
        for _ in range(2)
    ]  # fmt: skip
    for t, d, offset, theta in cases:
        x = torch.randn(t, d, generator=generator)
        cos, sin = rope_cos_sin(torch.arange(offset, offset + t)[None], d, theta)
        expected = apply_rope(x[None, None], cos, sin)[0, 0]
        got = rope_at_offset(x.clone(), offset, theta)
        assert isinstance(got, torch.Tensor) and got.shape == x.shape, (
            f"rope_at_offset should return a {tuple(x.shape)} tensor, got "
            f"{getattr(got, 'shape', type(got).__name__)}"
        )
        assert got.dtype == x.dtype, (
            f"rope_at_offset should keep the input's dtype {x.dtype}, got {got.dtype}"
        )
        assert_close(
            got,
            expected,
            name=f"rope_at_offset for T={t}, D={d}, offset={offset}, theta={theta:g}",
            rtol=1e-4,
            atol=1e-5,
        )


@question(function="static_cache_insert", blocked=("kvlib.cache.StaticCache",))
def test_static_cache_insert(submission: Submission) -> None:
    insert = submission.function("static_cache_insert")
    drawn = submission.rng()
    writes = [int(n) for n in drawn.integers(1, 5, size=int(drawn.integers(1, 5)))]
    shape = tuple(int(n) for n in drawn.integers(1, 4, size=3))  # (B, H, D), drawn per run
    cases = [((2, 3, 4), 10, (4, 1, 1, 3)), (shape, sum(writes), tuple(writes))]
    for (batch, heads, dim), capacity, writes in cases:  # the second fills the buffer exactly
        _check_inserts(insert, batch, heads, dim, capacity, writes)


def _check_inserts(insert, batch, heads, dim, capacity, writes) -> None:
    generator = torch.Generator().manual_seed(3)
    buffer = torch.zeros(batch, heads, capacity, dim)
    expected = torch.zeros(batch, heads, capacity, dim)
    length = 0
    for t in writes:
        k_new = torch.randn(batch, heads, t, dim, generator=generator)
        expected[:, :, length : length + t] = k_new
        call = insert.call(buffer, length, k_new, _options={"mutates": {0}, "may_alias": True})
        view, buffer = call.result, call.args[0]
        assert isinstance(view, torch.Tensor) and view.shape == (batch, heads, length + t, dim), (
            f"after writing {t} tokens at length {length} into a buffer of {capacity}, return "
            f"the (B, H, {length + t}, D) view, got {tuple(getattr(view, 'shape', ()))}"
        )
        assert torch.equal(buffer, expected), (
            f"the buffer should hold the new rows at positions {length}..{length + t - 1}: it does "
            "not"
        )
        assert 0 in call.aliases, (
            "return a view of the buffer (no copy): the point of a static cache"
        )
        length += t
    overflow = capacity - length + 1  # one token more than the room left
    try:
        insert(buffer, length, torch.zeros(batch, heads, overflow, dim))
    except LearnerRaised as error:
        assert error.type_name == "ValueError", (
            f"an overflow should raise ValueError, got {error.type_name}"
        )
        assert str(error).split(": ", 1)[1], "the overflow error should say what happened"
    else:
        raise AssertionError(
            f"writing {overflow} tokens after {length} into a buffer of {capacity} should raise "
            "ValueError (overflow), it did not"
        )


@question(
    function="reorder_for_beams", blocked=("kvlib.cache.DynamicCache", "kvlib.cache.StaticCache")
)
def test_reorder_for_beams(submission: Submission) -> None:
    reorder = submission.function("reorder_for_beams")
    generator, drawn = torch.Generator().manual_seed(4), submission.rng()
    cases = [(4, 3, [2, 2, 0, 3]), (4, 3, [0, 1, 2, 3]), (4, 3, [3, 3, 3, 3])]
    beams, num_layers = int(drawn.integers(1, 7)), int(drawn.integers(1, 4))  # drawn per run
    cases.append((beams, num_layers, [int(i) for i in drawn.integers(0, beams, size=beams)]))
    for beams, num_layers, beam_indices in cases:
        _check_reorder(reorder, generator, beams, num_layers, beam_indices)


def _check_reorder(reorder, generator, beams, num_layers, beam_indices) -> None:
    layers = [
        (
            torch.randn(beams, 2, 5, 3, generator=generator),
            torch.randn(beams, 2, 5, 3, generator=generator),
        )
        for _ in range(num_layers)
    ]
    indices = torch.tensor(beam_indices)
    got = reorder([(k.clone(), v.clone()) for k, v in layers], indices)
    assert isinstance(got, list) and len(got) == num_layers, (
        f"return one (keys, values) pair per layer ({num_layers}), got {type(got).__name__}"
    )
    for i, ((k, v), (got_k, got_v)) in enumerate(zip(layers, got)):
        assert torch.equal(got_k, k[indices]), (
            f"layer {i} keys: new beam j must hold the keys of old beam beam_indices[j] = "
            f"{beam_indices}"
        )
        assert torch.equal(got_v, v[indices]), (
            f"layer {i} values: new beam j must hold the values of old beam beam_indices[j] = "
            f"{beam_indices}"
        )
