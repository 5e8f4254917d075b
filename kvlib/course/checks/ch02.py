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
    generator = torch.Generator().manual_seed(2)
    for t, d, offset, theta in [(1, 8, 0, 10000.0), (5, 16, 37, 10000.0), (3, 8, 1000, 500000.0)]:
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
    generator = torch.Generator().manual_seed(3)
    buffer = torch.zeros(2, 3, 10, 4)
    expected = torch.zeros(2, 3, 10, 4)
    length = 0
    for t in (4, 1, 1, 3):
        k_new = torch.randn(2, 3, t, 4, generator=generator)
        expected[:, :, length : length + t] = k_new
        call = insert.call(buffer, length, k_new, _options={"mutates": {0}, "may_alias": True})
        view, buffer = call.result, call.args[0]
        assert isinstance(view, torch.Tensor) and view.shape == (2, 3, length + t, 4), (
            f"after writing {t} tokens at length {length}, return the (B, H, {length + t}, D) "
            f"view, got {tuple(getattr(view, 'shape', ()))}"
        )
        assert torch.equal(buffer, expected), (
            f"the buffer should hold the new rows at positions {length}..{length + t - 1}: it does "
            "not"
        )
        assert 0 in call.aliases, (
            "return a view of the buffer (no copy): the point of a static cache"
        )
        length += t
    try:
        insert(buffer, length, torch.zeros(2, 3, 2, 4))
    except LearnerRaised as error:
        assert error.type_name == "ValueError", (
            f"an overflow should raise ValueError, got {error.type_name}"
        )
        assert str(error).split(": ", 1)[1], "the overflow error should say what happened"
    else:
        raise AssertionError(
            f"writing 2 tokens after {length} into a buffer of 10 should raise ValueError "
            "(overflow), it did not"
        )


@question(
    function="reorder_for_beams", blocked=("kvlib.cache.DynamicCache", "kvlib.cache.StaticCache")
)
def test_reorder_for_beams(submission: Submission) -> None:
    reorder = submission.function("reorder_for_beams")
    generator = torch.Generator().manual_seed(4)
    layers = [
        (torch.randn(4, 2, 5, 3, generator=generator), torch.randn(4, 2, 5, 3, generator=generator))
        for _ in range(3)
    ]
    for beam_indices in ([2, 2, 0, 3], [0, 1, 2, 3], [3, 3, 3, 3]):
        indices = torch.tensor(beam_indices)
        got = reorder([(k.clone(), v.clone()) for k, v in layers], indices)
        assert isinstance(got, list) and len(got) == 3, (
            f"return one (keys, values) pair per layer (3), got {type(got).__name__}"
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
