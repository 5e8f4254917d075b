"""Chapter 4's graded questions: the online softmax update, the LSE merge, a tiled attention pass.

The tests compare with kvlib's reference implementations (imported before the grader blocks
them) on inputs large enough that forgetting the running maximum overflows.
"""

from __future__ import annotations

import math

import numpy as np

from kvlib.course.grading import Submission, question
from kvlib.ref.attention import attention, softmax
from kvlib.ref.online_softmax import (
    RowReadCounter,
    merge_partials,
    online_softmax_update,
    partial_attention,
)
from kvlib.testing import assert_close

MAX_TILED_BYTES = 512 * 2**10  # kvlib's tiled_attention peaks near 80 KiB at the shape below


@question(
    function="online_softmax_update", blocked=("kvlib.ref.online_softmax.online_softmax_update",)
)
def test_online_softmax_update(submission: Submission) -> None:
    update = submission.function("online_softmax_update")
    rng, drawn = np.random.default_rng(4), submission.rng()
    cases = [(1.0, 5, 30), (50.0, 4, 30), (400.0, 7, 30)]
    cases.append(
        (float(10 ** drawn.uniform(0, 3)), int(drawn.integers(1, 9)), int(drawn.integers(1, 40)))
    )
    for magnitude, block, length in cases:  # the last one drawn per run
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


@question(function="merge_two", blocked=("kvlib.ref.online_softmax.merge_partials",))
def test_merge_two(submission: Submission) -> None:
    merge_two = submission.function("merge_two")
    rng, drawn = np.random.default_rng(5), submission.rng()
    cases = [(1.0, 3, 20, 6), (40.0, 3, 20, 6)]
    keys = int(drawn.integers(2, 30))  # drawn per run: shapes, a split point, a magnitude
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
    out_a, lse_a = rng.normal(size=(2, 4)), np.array([1000.0, -3.0])
    out_b, lse_b = rng.normal(size=(2, 4)), np.array([999.0, -np.inf])  # huge lse; an empty chunk
    out, lse = merge_two(out_a, lse_a, out_b, lse_b)
    expected_out, expected_lse = merge_partials([out_a, out_b], [lse_a, lse_b])
    assert np.all(np.isfinite(np.asarray(out))), (
        "with lse = 1000 and 999 (or an empty chunk, lse = -inf) your output has non-finite "
        f"values {np.asarray(out).tolist()}: "
        "weight by exp(lse - max lse), and give an lse of -inf the weight 0"
    )
    assert_close(out, expected_out, name="merged output for lse = [1000, 999] and an empty chunk")
    assert_close(lse, expected_lse, name="merged lse for lse = [1000, 999] and an empty chunk")


@question(
    function="tiled_attention",
    blocked=(
        "kvlib.ref.online_softmax.tiled_attention",
        "kvlib.ref.online_softmax.two_pass_attention",
        "kvlib.ref.online_softmax.three_pass_attention",
        # the whole-cache routes a learner could feed concatenated tiles to:
        "kvlib.ref.attention.attention",
        "kvlib.ref.attention.attention_weights",
        "kvlib.ref.attention.softmax",
        "kvlib.ref.online_softmax.partial_attention",
        "kvlib.ref.online_softmax.split_k_attention",
    ),
)
def test_tiled_attention(submission: Submission) -> None:
    tiled = submission.function("tiled_attention")
    rng, drawn = np.random.default_rng(6), submission.rng()
    random_case = (  # drawn per run (seeded from the answer's source)
        *(int(n) for n in drawn.integers(1, (6, 50, 17))),
        float(10 ** drawn.uniform(0, 1.5)),
    )
    for t, s, tile_size, magnitude in (
        (1, 10, 4, 1.0),
        (5, 37, 8, 1.0),
        (3, 64, 16, 30.0),
        (4, 7, 32, 1.0),
        random_case,
    ):
        q, k, v = (
            rng.normal(size=(t, 8)) * magnitude,
            rng.normal(size=(s, 8)),
            rng.normal(size=(s, 3)),
        )
        k_reads, v_reads = (
            RowReadCounter(k, max_rows_per_read=tile_size),
            RowReadCounter(v, max_rows_per_read=tile_size),
        )
        call = tiled.call(q, k_reads, v_reads, tile_size)
        out = call.result
        # the counters counted in the learner's process; they came back with the arguments
        k_passes, v_passes = (getattr(c, "rows_read", 0) / s for c in call.args[1:3])
        assert_close(
            out,
            attention(q, k, v),
            name=f"tiled_attention with T={t}, S={s}, tile_size={tile_size}, queries "
            f"~{magnitude:.3g}",
        )
        assert k_passes == 1 and v_passes == 1, (
            f"with S={s}, tile_size={tile_size} you read K {k_passes:g} times and V "
            f"{v_passes:g} times; "
            "a tiled pass reads each exactly once"
        )
    # A tiled pass holds one tile of scores, never the T x S matrix or a gathered copy of K/V.
    t, s, tile_size = 32, 8192, 64
    q, k, v = rng.normal(size=(t, 32)), rng.normal(size=(s, 32)), rng.normal(size=(s, 16))
    k_reads = RowReadCounter(k, max_rows_per_read=tile_size)
    v_reads = RowReadCounter(v, max_rows_per_read=tile_size)
    measured = tiled.call(q, k_reads, v_reads, tile_size, _options={"measure_memory": True}).info
    peak = measured["python_peak_bytes"] + measured["torch_peak_bytes"]
    assert peak <= MAX_TILED_BYTES, (
        f"with T={t}, S={s}, tile_size={tile_size} your function held {peak / 2**10:,.0f} KiB at "
        f"its peak (numpy/Python allocations traced by tracemalloc + PyTorch's CPU allocator); a "
        f"tiled pass needs far less than the {t * s * 8 / 2**20:.0f} MiB of a T x S "
        f"score matrix or of a gathered copy of K (at most {MAX_TILED_BYTES // 2**10} KiB here): "
        "keep only the running max, denominator and accumulator between tiles"
    )
