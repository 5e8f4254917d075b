"""Chapter 4's graded questions: the online softmax update, the LSE merge, a tiled attention pass.

The tests compare with kvlib's reference implementations on inputs large enough that forgetting the
running maximum overflows. The tiled pass reads K and V from the grader, a tile at a time
(`Submission.rows`): the grader counts what it served, and reads the call's peak memory from
outside the learner's process.
"""

from __future__ import annotations

import math

import numpy as np

from kvlib.course.grading import Submission, peak_allocation, question
from kvlib.ref.attention import attention, softmax
from kvlib.ref.online_softmax import merge_partials, online_softmax_update, partial_attention
from kvlib.testing import assert_close

MAX_TILED_BYTES = 3 * 2**20  # a tiled pass holds ~100 KiB at the shape below; K alone 8 MiB


@question(function="online_softmax_update")
def test_online_softmax_update(submission: Submission) -> None:
    update = submission.function("online_softmax_update")
    rng, drawn = np.random.default_rng(4), submission.rng()
    cases = submission.fixed([(1.0, 5, 30), (50.0, 4, 30), (400.0, 7, 30), (3000.0, 5, 30)])
    cases.append(
        (float(10 ** drawn.uniform(0, 3.5)), int(drawn.integers(1, 9)), int(drawn.integers(1, 40)))
    )
    for magnitude, block, length in cases:  # the last one drawn afresh on every run
        x = rng.normal(size=length) * magnitude
        # the maximum keeps rising: rescales needed
        x[::7] += np.linspace(0, 3 * magnitude, len(x[::7]))
        m, l = -math.inf, 0.0
        expected = (-math.inf, 0.0)
        for start in range(0, x.size, block):
            result = update(m, l, x[start : start + block].copy())
            assert isinstance(result, tuple) and len(result) == 2, (
                f"online_softmax_update should return (m_new, l_new), got {result!r}"
            )
            m, l = (float(r) for r in result)
            expected = online_softmax_update(*expected, x[start : start + block])
            assert math.isfinite(l), (
                f"with scores up to {x[: start + block].max():.0f} your l became {l}: measure exp "
                "against the running max"
            )
            assert_close(
                np.array([m, l]),
                np.array(expected),
                name=f"(m, l) after the block starting at {start} (blocks of {block}, scores "
                f"~{magnitude:.3g})",
            )
        assert_close(np.exp(x - m) / l, softmax(x), name="softmax from your final (m, l)")


@question(function="merge_two")
def test_merge_two(submission: Submission) -> None:
    merge_two = submission.function("merge_two")
    rng, drawn = np.random.default_rng(5), submission.rng()
    cases = submission.fixed([(1.0, 3, 20, 6), (40.0, 3, 20, 6)])
    keys = int(drawn.integers(2, 30))  # drawn afresh on every run: shapes, a split, a magnitude
    cases.append((float(10 ** drawn.uniform(0, 2)), int(drawn.integers(1, 6)), keys,
                  int(drawn.integers(1, keys))))  # fmt: skip
    for magnitude, queries, keys, split in cases:
        q, k, v = (
            rng.normal(size=(queries, 8)) * magnitude,
            rng.normal(size=(keys, 8)),
            rng.normal(size=(keys, 4)),
        )
        a, b = (
            partial_attention(q, k[:split], v[:split]),
            partial_attention(q, k[split:], v[split:]),
        )
        result = merge_two(a[0], a[1], b[0], b[1])
        assert isinstance(result, tuple) and len(result) == 2, (
            f"merge_two should return (out, lse), got {type(result).__name__}"
        )
        out, lse = result
        expected_out, expected_lse = merge_partials([a[0], b[0]], [a[1], b[1]])
        what = f"T={queries}, S={keys} split at {split}, scores ~{magnitude:.3g}"
        assert_close(out, attention(q, k, v), name=f"merged output ({what})")
        assert_close(lse, expected_lse, name=f"merged lse ({what})")
    if not submission.fixed_cases:
        return
    # huge lse; a row with one chunk empty (lse -inf); a row with both empty
    out_a, lse_a = rng.normal(size=(3, 4)), np.array([1000.0, -3.0, -np.inf])
    out_b, lse_b = rng.normal(size=(3, 4)), np.array([999.0, -np.inf, -np.inf])
    out_a[2], out_b[1:] = 0.0, 0.0
    out, lse = (np.asarray(r) for r in merge_two(out_a, lse_a, out_b, lse_b))
    expected_out, expected_lse = merge_partials([out_a, out_b], [lse_a, lse_b])
    assert np.all(np.isfinite(out)), (
        "with lse = 1000 and 999, or one chunk empty (lse = -inf), or both, your output has "
        "non-finite values: weight by exp(lse - max lse), give an lse of -inf the weight 0, and "
        f"where both chunks are empty return out = 0 and lse = -inf (rows: {out.tolist()})"
    )
    assert_close(out, expected_out, name="merged output for lse = [1000, 999], an empty chunk, "
                 "and two empty chunks")  # fmt: skip
    assert lse.shape == (3,) and np.isneginf(lse[2]) and np.isfinite(lse[:2]).all(), (
        f"merged lse {lse.tolist()}: where both chunks are empty (lse = -inf in each) the union "
        "is empty too: lse = -inf, and out = 0"
    )
    assert_close(lse[:2], expected_lse[:2], name="merged lse for lse = [1000, 999] and one chunk "
                 "empty")  # fmt: skip


@question(function="tiled_attention")
def test_tiled_attention(submission: Submission) -> None:
    tiled = submission.function("tiled_attention")
    rng, drawn = np.random.default_rng(6), submission.rng()
    random_case = (  # drawn afresh on every run
        *(int(n) for n in drawn.integers(1, (6, 50, 17))),
        float(10 ** drawn.uniform(0, 1.5)),
    )
    cases = submission.fixed([(1, 10, 4, 1.0), (5, 37, 8, 1.0), (3, 64, 16, 30.0), (4, 7, 32, 1.0)])
    for t, s, tile_size, magnitude in [*cases, random_case]:
        q, k, v = (
            rng.normal(size=(t, 8)) * magnitude,
            rng.normal(size=(s, 8)),
            rng.normal(size=(s, 3)),
        )
        k_rows, v_rows = submission.rows(k, tile_size), submission.rows(v, tile_size)
        out = tiled(q, k_rows, v_rows, tile_size)  # K and V stay here: read a tile at a time
        assert_close(
            out,
            attention(q, k, v),
            name=f"tiled_attention with T={t}, S={s}, tile_size={tile_size}, queries "
            f"~{magnitude:.3g}",
        )
        for rows, name in ((k_rows, "K"), (v_rows, "V")):
            reads = rows.reads if rows.reads is not None else np.zeros(s, dtype=np.int64)
            assert (reads == 1).all(), (
                f"with S={s}, tile_size={tile_size} you read {name} {reads.sum() / s:g} times "
                f"(rows read 0 times: {int((reads == 0).sum())}, more than once: "
                f"{int((reads > 1).sum())}); a tiled pass reads each row exactly once"
            )
    if not submission.fixed_cases:
        return
    # A tiled pass holds one tile of scores, never the T x S matrix or a gathered copy of K/V.
    t, s, tile_size = 32, 32768, 128
    q, k, v = rng.normal(size=(t, 32)), rng.normal(size=(s, 32)), rng.normal(size=(s, 16))
    measured = tiled.call(
        q, submission.rows(k, tile_size), submission.rows(v, tile_size), tile_size,
        _options={"measure_memory": True},
    ).info  # fmt: skip
    peak, described = peak_allocation(measured)
    assert peak <= MAX_TILED_BYTES, (
        f"with T={t}, S={s}, tile_size={tile_size} your function held {described} at its peak; "
        f"a tiled pass needs far less than the {t * s * 8 / 2**20:.0f} MiB of a T x S score "
        f"matrix or the {s * 32 * 8 / 2**20:.0f} MiB of a gathered copy of K (at most "
        f"{MAX_TILED_BYTES / 2**20:g} MiB here): keep only the running max, denominator and "
        "accumulator between tiles"
    )
