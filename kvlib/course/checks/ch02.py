"""Chapter 2's graded questions: RoPE at an offset, the static cache's insert, reordering caches for
beams. Oracles: the rotation in float64 (`rope_exact`, with what float32 may be off by) and the
rules written out here."""

from __future__ import annotations

import torch

from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import LearnerRaised, Submission, question

EPS32 = 2.0**-23  # float32's machine epsilon


def rope_exact(x: torch.Tensor, positions: torch.Tensor, theta: float):
    """RoPE of `x` (..., T, D) at `positions` (T,) in float64 (Hugging Face's convention: pairs
    i, i + D/2, frequencies theta^(-2i/D)), and what a float32 computation may be off by: its
    angles carry a relative error of a few float32 epsilons (frequencies from a float32 power,
    products rounded), which rotates each pair by up to ~angle · 1e-6, plus the output's own
    rounding. Returns (expected float64, allowed error), both of x's shape."""
    d = x.shape[-1]
    inv_freq = float(theta) ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    angles = positions.double()[:, None] * inv_freq  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    x64 = x.double()
    x1, x2 = x64.chunk(2, dim=-1)
    expected = x64 * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()
    radius = torch.cat([(x1**2 + x2**2).sqrt()] * 2, dim=-1)  # each pair's length
    allowed = 32 * EPS32 * angles.abs() * radius + 8 * EPS32 * (radius + expected.abs()) + 1e-12
    return expected, allowed


def assert_rotated(got: torch.Tensor, expected: torch.Tensor, allowed: torch.Tensor, name: str):
    """Fail with the worst element unless |got - expected| <= allowed everywhere."""
    error = (got.double() - expected).abs()
    excess = error - allowed
    worst = int(excess.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), error.shape))
    assert bool((excess <= 0).all()) and bool(torch.isfinite(got).all()), (
        f"{name}: at index {index} got {float(got.reshape(-1)[worst]):.6g}, expected "
        f"{float(expected.reshape(-1)[worst]):.6g} (exact, float64); float32 may be off by "
        f"{float(allowed.reshape(-1)[worst]):.2g} there"
    )


@question(function="rope_at_offset")
def test_rope_at_offset(submission: Submission) -> None:
    rope_at_offset = submission.function("rope_at_offset")
    generator, drawn = torch.Generator().manual_seed(2), submission.rng()
    cases = submission.fixed([(1, 8, 0, 10000.0), (5, 16, 37, 10000.0), (3, 8, 1000, 500000.0),
                              (4, 32, 4990, 1e6)])  # fmt: skip
    cases += [  # drawn afresh on every run
        (int(drawn.integers(1, 7)), 2 * int(drawn.integers(1, 17)), int(drawn.integers(0, 5000)),
         float(drawn.choice([10000.0, 500000.0, 1e6])))
        for _ in range(2)
    ]  # fmt: skip
    for t, d, offset, theta in cases:
        x = torch.randn(t, d, generator=generator)
        expected, allowed = rope_exact(x, torch.arange(offset, offset + t), theta)
        got = rope_at_offset(x.clone(), offset, theta)
        assert isinstance(got, torch.Tensor) and got.shape == x.shape, (
            f"rope_at_offset should return a {tuple(x.shape)} tensor, got "
            f"{getattr(got, 'shape', type(got).__name__)}"
        )
        assert got.dtype == x.dtype, (
            f"rope_at_offset should keep the input's dtype {x.dtype}, got {got.dtype}"
        )
        with naming_mistakes(got, rope_mistakes(x, offset, theta), rtol=1e-3,
                             atol=float(allowed.max())):  # fmt: skip
            assert_rotated(
                got, expected, allowed, f"rope_at_offset for T={t}, D={d}, offset={offset}, "
                f"theta={theta:g}"
            )  # fmt: skip


def _rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE with GPT-J's pairing (2i, 2i + 1), in float64: a common mistake here."""
    d = x.shape[-1]
    inv_freq = float(theta) ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = (positions.double()[:, None] * inv_freq).repeat_interleave(2, dim=-1)
    x64 = x.double()
    rotated = torch.stack([-x64[..., 1::2], x64[..., 0::2]], dim=-1).flatten(-2)
    return x64 * angles.cos() + rotated * angles.sin()


def rope_mistakes(x: torch.Tensor, start: int, theta: float) -> dict:
    """The common RoPE mistakes for `x` (..., T, D) at positions start, start + 1, ..."""
    positions = torch.arange(start, start + x.shape[-2])
    return {
        "the offset ignored: every call rotates from position 0, not from the cached length": (
            lambda: rope_exact(x, positions - start, theta)[0]
        ),
        "GPT-J's interleaved pairs (2i, 2i + 1): this model pairs dimension i with i + D/2": (
            lambda: _rope_interleaved(x, positions, theta)
        ),
        "the rotation in the wrong direction (the sine's sign flipped)": lambda: rope_exact(
            x, -positions, theta
        )[0],
        "frequencies theta^(-i/D), not theta^(-2i/D)": lambda: rope_exact(
            x, positions, float(theta) ** 0.5
        )[0],
        "no rotation at all": lambda: x.double(),
    }


@question(function="static_cache_insert")
def test_static_cache_insert(submission: Submission) -> None:
    insert = submission.function("static_cache_insert")
    drawn = submission.rng()
    writes = [int(n) for n in drawn.integers(1, 5, size=int(drawn.integers(1, 5)))]
    shape = tuple(int(n) for n in drawn.integers(1, 4, size=3))  # (B, H, D), drawn per run
    cases = submission.fixed([((2, 3, 4), 10, (4, 1, 1, 3))])
    cases.append((shape, sum(writes), tuple(writes)))  # fills the buffer exactly
    for (batch, heads, dim), capacity, writes in cases:
        _check_inserts(submission, insert, batch, heads, dim, capacity, writes)


def _check_inserts(submission, insert, batch, heads, dim, capacity, writes) -> None:
    generator = torch.Generator().manual_seed(3)
    buffer = torch.zeros(batch, heads, capacity, dim)
    expected = torch.zeros(batch, heads, capacity, dim)
    length = 0
    options = {"mutates": {0}, "may_alias": True}
    for t in writes:
        k_new = torch.randn(batch, heads, t, dim, generator=generator)
        before = expected.clone()
        expected[:, :, length : length + t] = k_new
        call = insert.call(buffer, length, k_new, _options=options)
        view, buffer = call.result, call.args[0]
        mistakes = _insert_mistakes(before, expected, length, k_new)
        right = (expected[:, :, : length + t], expected)
        shaped = isinstance(view, torch.Tensor) and view.shape == (batch, heads, length + t, dim)
        with naming_mistakes((view, buffer), mistakes, rtol=0.0, atol=0.0, expected=right):
            assert shaped, (
                f"after writing {t} tokens at length {length} into a buffer of {capacity}, return "
                f"the (B, H, {length + t}, D) view, got {tuple(getattr(view, 'shape', ()))}"
            )
            assert torch.equal(buffer, expected), (
                f"the buffer should hold the new rows at positions {length}..{length + t - 1}: it "
                "does not"
            )
        if 0 not in call.aliases + call.views:
            submission.flag(
                "static_cache_insert returned a copy: return a view of the buffer (no copy), the "
                "point of a static cache"
            )
        length += t
    overflow = capacity - length + 1  # one token more than the room left
    k_new = torch.randn(batch, heads, overflow, dim, generator=generator) + 1.0
    try:
        insert.call(buffer, length, k_new, _options=options)
    except LearnerRaised as error:
        assert error.is_a("ValueError"), (
            f"an overflow should raise ValueError (or a subclass), got {error.type_name}"
        )
        assert str(error).split(": ", 1)[1], "the overflow error should say what happened"
        after = error.args_after[0] if error.args_after else buffer
        assert torch.equal(after, buffer), (
            f"writing {overflow} tokens after {length} into a buffer of {capacity} raised, but "
            "changed the buffer first: on an overflow, write nothing"
        )
    else:
        raise AssertionError(
            f"writing {overflow} tokens after {length} into a buffer of {capacity} should raise "
            "ValueError (overflow), it did not"
        )


def _insert_mistakes(before, after, length, k_new) -> dict:
    """static_cache_insert's common mistakes, each as (the view returned, the buffer after it):
    `before` and `after` are the buffer before and after a right insert."""
    t = k_new.shape[2]

    def at_start():
        buffer = before.clone()
        buffer[:, :, :t] = k_new
        return buffer[:, :, : length + t], buffer

    return {
        "the view of the new rows only: return the first length + T positions, the cache so far": (
            lambda: (after[:, :, length : length + t], after)
        ),
        "the whole buffer returned: return the view of its first length + T positions": lambda: (
            after,
            after,
        ),
        "the new rows written at position 0: write them after the `length` cached ones": at_start,
    }


@question(function="reorder_for_beams")
def test_reorder_for_beams(submission: Submission) -> None:
    reorder = submission.function("reorder_for_beams")
    generator, drawn = torch.Generator().manual_seed(4), submission.rng()
    cases = submission.fixed([(4, 3, [2, 2, 0, 3]), (4, 3, [0, 1, 2, 3]), (4, 3, [3, 3, 3, 3])])
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
    mistakes = {
        "the keys reordered but the values left as they were": lambda: [
            (k[indices], v) for k, v in layers
        ],
        "old beam j moved to new beam beam_indices[j] (a scatter): new beam j takes old beam "
        "beam_indices[j]": lambda: [
            (_scatter(k, indices), _scatter(v, indices)) for k, v in layers
        ],
        "the caches left as they were": lambda: layers,
    }
    with naming_mistakes(got, mistakes, rtol=0.0, atol=0.0):
        _check_layers(got, layers, indices, beam_indices)


def _scatter(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    out[indices] = x
    return out


def _check_layers(got, layers, indices, beam_indices) -> None:
    for i, ((k, v), (got_k, got_v)) in enumerate(zip(layers, got)):
        assert torch.equal(got_k, k[indices]), (
            f"layer {i} keys: new beam j must hold the keys of old beam beam_indices[j] = "
            f"{beam_indices}"
        )
        assert torch.equal(got_v, v[indices]), (
            f"layer {i} values: new beam j must hold the values of old beam beam_indices[j] = "
            f"{beam_indices}"
        )
