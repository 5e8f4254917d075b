"""Chapter 4's graded questions: the online softmax update, the LSE merge, a tiled attention pass.

The tests compare with kvlib's reference implementations on inputs large enough that forgetting the
running maximum overflows. The tiled pass reads K and V from the grader, a tile at a time
(`Submission.rows`): the grader counts what it served, and reads the call's peak memory from
outside the learner's process.
"""

from __future__ import annotations

import math

import numpy as np

from kvlib.course.checks.mistakes import naming_mistakes
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
            mistakes = _update_mistakes(m, l, x[start : start + block])
            m, l = (float(r) for r in result)
            expected = online_softmax_update(*expected, x[start : start + block])
            with naming_mistakes(np.array([m, l]), mistakes):
                assert math.isfinite(l), (
                    f"with scores up to {x[: start + block].max():.0f} your l became {l}: measure "
                    "exp against the running max"
                )
                assert_close(
                    np.array([m, l]),
                    np.array(expected),
                    name=f"(m, l) after the block starting at {start} (blocks of {block}, scores "
                    f"~{magnitude:.3g})",
                )
        assert_close(np.exp(x - m) / l, softmax(x), name="softmax from your final (m, l)")


def _update_mistakes(m: float, l: float, block: np.ndarray) -> dict:
    """online_softmax_update's common mistakes from the state (m, l) it was given."""

    def update(rescale, own_max=False):
        m_new = max(m, float(block.max()))
        with np.errstate(all="ignore"):
            shift = float(block.max()) if own_max else m_new
            return np.array([m_new, l * rescale(m_new) + float(np.exp(block - shift).sum())])

    return {
        "l not rescaled when the maximum rises (multiply it by exp(m - m_new))": lambda: update(
            lambda m_new: 1.0
        ),
        "l rescaled by exp(m_new - m), the inverse of exp(m - m_new)": lambda: update(
            lambda m_new: np.exp(m_new - m)
        ),
        "the block's exponentials taken against the block's own maximum, not the running "
        "one": lambda: update(lambda m_new: np.exp(m - m_new), own_max=True),
        "no maximum at all: l accumulates exp(x) unshifted": lambda: np.array(
            [max(m, float(block.max())), l + float(np.exp(block).sum())]
        ),
    }


def _merge_mistakes(out_a, lse_a, out_b, lse_b) -> tuple[dict, dict]:
    """merge_two's common mistakes: for the output, and for the merged lse."""
    top = np.maximum(lse_a, lse_b)
    w_a, w_b = np.exp(lse_a - top), np.exp(lse_b - top)
    share_a, share_b = (w_a / (w_a + w_b))[:, None], (w_b / (w_a + w_b))[:, None]
    outs = {
        "the plain average of the two partial outputs: weight each by its share of the "
        "softmax mass, exp(lse_i - lse)": lambda: (out_a + out_b) / 2,
        "the weights swapped (out_a weighted by b's share)": lambda: (
            share_b * out_a + share_a * out_b
        ),
        "the partials weighted by exp(lse) without dividing by their sum": lambda: (
            w_a[:, None] * out_a + w_b[:, None] * out_b
        ),
    }
    lses = {
        "the larger lse: the merged lse is log(exp(lse_a) + exp(lse_b))": lambda: top,
        "lse_a + lse_b: add the exponentials, not the logs": lambda: lse_a + lse_b,
        "the mean of the two lse": lambda: (lse_a + lse_b) / 2,
    }
    return outs, lses


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
        out_mistakes, lse_mistakes = _merge_mistakes(a[0], a[1], b[0], b[1])
        with naming_mistakes(out, out_mistakes):
            assert_close(out, attention(q, k, v), name=f"merged output ({what})")
        with naming_mistakes(lse, lse_mistakes):
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
        with naming_mistakes(out, _tiled_mistakes(q, k, v, tile_size)):
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
    # Two measured calls on inputs drawn afresh (nothing to memoise or look up), the larger peak
    # kept: the cases before ran the same code, so a first call pays no warm-up here
    t, s, tile_size = 32, 32768, 128
    peaks = []
    for _ in range(2):
        q, k, v = drawn.normal(size=(t, 32)), drawn.normal(size=(s, 32)), drawn.normal(size=(s, 16))
        k_rows, v_rows = submission.rows(k, tile_size), submission.rows(v, tile_size)
        call = tiled.call(q, k_rows, v_rows, tile_size, _options={"measure_memory": True})
        assert_close(call.result, attention(q, k, v), name=f"tiled_attention with T={t}, S={s}")
        for rows, name in ((k_rows, "K"), (v_rows, "V")):
            assert (rows.reads == 1).all(), (
                f"with S={s}, tile_size={tile_size} you read {name} {rows.reads.sum() / s:g} "
                "times; a tiled pass reads each row exactly once"
            )
        peaks.append(peak_allocation(call.info))
    peak, described = max(peaks)
    assert peak <= MAX_TILED_BYTES, (
        f"with T={t}, S={s}, tile_size={tile_size} your function held {described} at its peak; "
        f"a tiled pass needs far less than the {t * s * 8 / 2**20:.0f} MiB of a T x S score "
        f"matrix or the {s * 32 * 8 / 2**20:.0f} MiB of a gathered copy of K (at most "
        f"{MAX_TILED_BYTES / 2**20:g} MiB here): keep only the running max, denominator and "
        "accumulator between tiles"
    )


def _tiled(q, k, v, tile_size: int, *, rescale_acc: bool = True, divide: bool = True):
    """A tiled pass with its mistakes switchable: the accumulator left unrescaled when the
    running maximum rises, or the output left undivided by the final denominator."""
    scale = q.shape[-1] ** -0.5
    m = np.full(q.shape[0], -np.inf)
    l, acc = np.zeros(q.shape[0]), np.zeros((q.shape[0], v.shape[1]))
    with np.errstate(all="ignore"):
        for start in range(0, k.shape[0], tile_size):
            scores = q @ k[start : start + tile_size].T * scale
            m_new = np.maximum(m, scores.max(axis=1))
            p, factor = np.exp(scores - m_new[:, None]), np.exp(m - m_new)
            l = l * factor + p.sum(axis=1)
            acc = (acc * factor[:, None] if rescale_acc else acc) + p @ v[start : start + tile_size]
            m = m_new
    return acc / l[:, None] if divide else acc


def _tiled_mistakes(q, k, v, tile_size: int) -> dict:
    """tiled_attention's common mistakes on these inputs, and what each returns."""
    return {
        "scores not scaled by 1/√D": lambda: attention(q, k, v, scale=1.0),
        "the accumulator not rescaled when the running maximum rises (multiply it by "
        "exp(m - m_new), as l)": lambda: _tiled(q, k, v, tile_size, rescale_acc=False),
        "the output not divided by the final denominator l": lambda: _tiled(
            q, k, v, tile_size, divide=False
        ),
        "each query attends to the last tile only (the tiles are not combined)": lambda: attention(
            q, k[-((k.shape[0] - 1) % tile_size + 1) :], v[-((k.shape[0] - 1) % tile_size + 1) :]
        ),
    }
