"""Chapter 17's graded questions: the slots of a sliding-window ring in the order a query reads
them, the blocks of a paged window that can go back to the pool (sink tokens kept), a softmax with
a learned sink (gpt-oss), split-K partials merged with that sink, and a hybrid model's cache bytes
(full, sliding-window and linear-attention layers). Oracles: `kvlib.course.checks.windows_answers`,
each written from its definition (every answer is written without kvlib)."""

from __future__ import annotations

import numpy as np

from kvlib.course.checks import windows_answers as answers
from kvlib.course.checks.calls import answer_of
from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Submission, expect_int, is_int, question


def _int_list(got, name: str) -> list[int]:
    """`got` as a list of Python ints: a list of ints or a 1-D numpy integer array."""
    if isinstance(got, np.ndarray) and got.ndim == 1 and (got.dtype.kind in "iu" or not len(got)):
        return [int(x) for x in got]
    assert isinstance(got, list) and all(is_int(x) for x in got), (
        f"{name} should return a list of ints (a 1-D numpy integer array passes too), got "
        f"{type(got).__name__} {_show(got)}"
    )
    return [int(x) for x in got]


def _show(values, most: int = 12) -> str:
    """A list, shortened past `most` items (its length then said)."""
    if not isinstance(values, list) or len(values) <= most:
        return repr(values)[:200]
    head = ", ".join(map(str, values[: most - 4]))
    return f"[{head}, ..., {', '.join(map(str, values[-3:]))}] ({len(values)} items)"


def _float64_array(got, shape: tuple, name: str) -> None:
    kind = type(got).__name__
    assert isinstance(got, np.ndarray), f"{name} should return a numpy array, got {kind}"
    assert got.shape == shape, f"{name}: expected shape {shape}, got {got.shape}"
    assert got.dtype == np.float64, f"{name}: expected dtype float64 (the inputs'), got {got.dtype}"


def _numbers(array: np.ndarray) -> str:
    text = np.array2string(array, precision=6, max_line_width=10_000, threshold=16)
    return text.replace("\n", "")


# --- question 1: the ring's slots, in the order a query reads them ------------------------------


_RING_CASES = [  # (num_positions, window, what)
    (0, 4, "nothing written yet: an empty ring"),
    (3, 4, "the ring has not wrapped"),
    (4, 4, "exactly W positions: every slot full, none overwritten"),
    (5, 4, "W + 1 positions: position 4 overwrote slot 0"),
    (10, 4, "wrapped twice"),
    (8, 4, "a multiple of W: the oldest held position is in slot 0 again"),
    (7, 3, "wrapped, W = 3"),
    (1, 1, "window 1, one position"),
    (6, 1, "window 1: only the newest position"),
    (2, 4096, "a long window, 2 positions"),
    (5000, 4096, "a long window, wrapped"),
    (1_000_003, 5, "a million positions"),
]


def _random_ring_case(rng) -> tuple:
    """W from 1 to 64; n empty, below, at or just above W, a multiple of W or anywhere up to 5 W."""
    window = int(rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 64]))
    kind = str(rng.choice(["below", "at", "above", "multiple", "any"]))
    n = {
        "below": int(rng.integers(0, window)),
        "at": window,
        "above": window + int(rng.integers(1, 3)),
        "multiple": window * int(rng.integers(2, 5)),
        "any": int(rng.integers(0, 5 * window + 2)),
    }[kind]
    return n, window, f"a random case ({kind} the window)"


@question(function="ring_slots")
def test_ring_slots(submission: Submission) -> None:
    ring_slots = submission.function("ring_slots")
    rng = submission.rng()  # random cases are drawn afresh on every run
    cases = [*submission.fixed(_RING_CASES), *(_random_ring_case(rng) for _ in range(6))]
    for n, window, what in cases:
        expected = answers.ring_order(n, window)
        case = f"n = {n}, W = {window} ({what})"
        got = _int_list(answer_of(ring_slots, (n, window), case), "ring_slots")
        held = f"positions {max(0, n - window)} .. {n - 1}" if n else "no position"
        with naming_mistakes(got, answers.ring_mistakes(n, window), expected=expected):
            assert got == expected, (
                f"{case}: expected the slots {_show(expected)}, got {_show(got)} (the ring holds "
                f"{held}; oldest first, slot = position mod W)"
            )


# --- question 2: the blocks a paged window can free ---------------------------------------------


_FREEABLE_CASES = [  # (num_positions, window, block_size, sink_tokens or None: left out, what)
    (8, 4, 4, 0, "block 0 out of the window"),
    (7, 4, 4, 0, "position 3 = n - W just out"),
    (6, 4, 4, 0, "block 0 still holds position 3 = n - W + 1"),
    (4, 4, 4, 0, "n = W: position 0 out, not all of block 0"),
    (3, 8, 4, 0, "fewer positions than the window"),
    (20, 4, 4, 0, "block 4 (16 .. 19) partly out"),
    (5, 1, 4, 0, "window 1: block 1 holds the query itself"),
    (37, 10, 3, 0, "blocks of 3"),
    (40, 8, 4, None, "sink_tokens left out: its default, 0"),
    (20, 12, 4, 8, "the window's W keys besides the 8 sinks"),
    (20, 4, 4, 4, "block 0 holds the sinks"),
    (20, 4, 4, 5, "block 1 holds the fifth sink"),
    (20, 4, 4, 2, "block 0 holds the sinks"),
    (12, 4, 1, 3, "blocks of 1 token"),
    (10, 4, 4, 12, "more sinks than positions out of the window"),
    (100, 16, 16, 4, "blocks of 16, window 16"),
    (0, 4, 1, 0, "no position yet: nothing to free"),
    (2, 4, 1, 0, "blocks of 1, fewer positions than the window"),
    (4, 4, 1, 0, "blocks of 1, n = W: position 0 = n - W out"),
    (8, 1, 4, 0, "window 1, n a multiple of the block size: the last block is the next write's"),
    (7, 4, 1, 3, "blocks of 1, n = W + sinks: one position between the sinks and the window"),
]


def _random_freeable_case(rng) -> tuple:
    """Blocks of 1 to 16 tokens (not only powers of two), W from 1 to 64, 0 to 20 sink tokens
    (sometimes a multiple of the block size), n below, at or near W, at a block's edge past the
    window, or anywhere up to 300."""
    block_size = int(rng.choice([1, 2, 3, 4, 5, 8, 16]))
    window = int(rng.choice([1, 2, 4, 7, 8, 16, 32, 64]))
    sinks = int(rng.choice([0, 0, int(rng.integers(1, 21)), block_size * int(rng.integers(1, 3))]))
    kind = str(rng.choice(["below", "near", "edge", "any"]))
    n = {
        "below": int(rng.integers(0, window + 1)),
        "near": window + int(rng.integers(-1, 3)),
        "edge": window - 1 + block_size * int(rng.integers(1, 6)) + int(rng.integers(-1, 2)),
        "any": int(rng.integers(0, 301)),
    }[kind]
    return max(n, 0), window, block_size, sinks, f"a random case ({kind})"


@question(function="freeable_blocks")
def test_freeable_blocks(submission: Submission) -> None:
    freeable_blocks = submission.function("freeable_blocks")
    rng = submission.rng()
    cases = [
        *submission.fixed(_FREEABLE_CASES),
        *(_random_freeable_case(rng) for _ in range(6)),
    ]
    for n, window, block_size, sinks, what in cases:
        args = (n, window, block_size) + (() if sinks is None else (sinks,))
        sinks = sinks or 0
        expected = answers.freeable(n, window, block_size, sinks)
        case = f"n = {n}, W = {window}, block_size = {block_size}, sink_tokens = {sinks} ({what})"
        got = _int_list(answer_of(freeable_blocks, args, case), "freeable_blocks")
        out = f"positions {sinks} .. {n - window} are out" if n - window >= sinks else (
            "no position is out")  # fmt: skip
        mistakes = answers.freeable_mistakes(n, window, block_size, sinks)
        with naming_mistakes(got, mistakes, expected=expected):
            assert got == expected, (
                f"{case}: expected the blocks {_show(expected)}, got {_show(got)} ({out}: the "
                f"query at {n} sees {max(0, n - window + 1)} .. {n} and the sinks; a block goes "
                "when all its positions are out)"
            )


# --- question 3: a softmax with a learned sink -------------------------------------------------


def _rows(values) -> np.ndarray:
    return np.array(values, dtype=np.float64)


_INF = float("inf")
_SINK_CASES = [  # (scores (H, S), sink (H,), what)
    (_rows([[2.0, 2.0, 2.0]]), _rows([2.0]), "the sink equal to every score: 1/4 each"),
    (_rows([[1.0, 2.0, 3.0], [0.0, -1.0, 5.0]]), _rows([0.5, -2.0]), "two heads, two sinks"),
    (_rows([[1000.0, 999.0, 998.0]]), _rows([999.5]), "scores near 1000: exp(1000) overflows"),
    (_rows([[-1000.0, -1001.0]]), _rows([-1000.5]), "scores and sink near -1000: exp underflows"),
    (_rows([[1000.0, 999.0], [-1000.0, -1001.0]]), _rows([1000.0, -1000.0]),
     "rows at opposite ends: each row's own maximum subtracted"),
    (_rows([[1000.0, 1000.0]]), _rows([0.0]), "a sink far below scores near 1000"),
    (_rows([[0.0, 1.0]]), _rows([30.0]), "a sink far above the scores: the head attends to "
     "almost nothing"),
    (_rows([[2.0, 1.0]]), _rows([-1000.0]), "a sink far below: a plain softmax"),
    (_rows([[1.0, 2.0, 0.0], [0.5, 0.5, 3.0], [-1.0, 0.0, 1.0]]), _rows([0.0, 2.0, -3.0]),
     "3 heads, 3 keys, each head its own sink"),
    (_rows([[4.0], [-3.0]]), _rows([4.0, 0.0]), "one key"),
    (_rows([[-_INF, 0.5, 1.0, -_INF], [0.0, -_INF, -_INF, -_INF]]), _rows([0.0, 1.0]),
     "masked keys (-inf): weight 0"),
]  # fmt: skip


def _random_sink_case(rng) -> tuple:
    """H from 1 to 6, S from 1 to 40 (sometimes S = H); scores of spread 0.1 to 100 around 0,
    +-500 or +-1000; the sink near them, far above or below, or equal to a row's maximum; a few
    keys masked (-inf) a third of the time, never a whole row."""
    heads = int(rng.integers(1, 7))
    keys = heads if rng.random() < 0.2 else int(rng.integers(1, 41))
    spread = float(rng.choice([0.1, 1.0, 10.0, 100.0]))
    offsets = np.array([0.0, 0.0, 500.0, -500.0, 1000.0, -1000.0])
    offset = rng.choice(offsets, size=(heads, 1))  # each head's own: rows far apart
    scores = offset + spread * rng.normal(size=(heads, keys))
    offset = offset[:, 0]
    kind = str(rng.choice(["near", "above", "below", "tie"]))
    sink = {
        "near": offset + spread * rng.normal(size=heads),
        "above": scores.max(axis=1) + rng.uniform(5, 60, size=heads),
        "below": scores.min(axis=1) - rng.uniform(5, 60, size=heads),
        "tie": scores.max(axis=1),
    }[kind]
    if keys > 1 and rng.random() < 0.33:
        masked = rng.random((heads, keys)) < 0.4
        masked[np.arange(heads), rng.integers(0, keys, size=heads)] = False  # a key per row
        scores[masked] = -np.inf
    return scores, sink, f"a random case (H = {heads}, S = {keys}, the sink {kind})"


@question(function="softmax_with_sink")
def test_softmax_with_sink(submission: Submission) -> None:
    softmax_with_sink = submission.function("softmax_with_sink")
    rng = submission.rng()
    cases = [*submission.fixed(_SINK_CASES), *(_random_sink_case(rng) for _ in range(6))]
    for scores, sink, what in cases:
        expected = answers.sink_softmax(scores, sink)
        shown = f"scores {_numbers(scores)}, sink {_numbers(sink)}" if scores.size <= 12 else (
            f"scores of shape {scores.shape}")  # fmt: skip
        got = answer_of(softmax_with_sink, (scores.copy(), sink.copy()), f"{what} ({shown})")
        _float64_array(got, scores.shape, "softmax_with_sink")
        mistakes = answers.sink_softmax_mistakes(scores, sink)
        # a mistake is named within the check's own tolerance, no looser (allclose is one-sided)
        with naming_mistakes(got, mistakes, expected=expected, rtol=0.5e-9, atol=1e-300):
            assert np.allclose(got, expected, rtol=1e-9, atol=1e-300), (
                f"{what} ({shown}): expected rows summing to {_numbers(expected.sum(axis=1))}, "
                f"got {_numbers(got.sum(axis=1))} (each weight within a relative 1e-9 of "
                "exp(s_j - m) / (exp(sink - m) + sum_k exp(s_k - m)), m the largest of the row's "
                "scores and its sink)"
            )


# --- question 4: split-K partials merged with the sink ------------------------------------------


def _split_case(scores, values, bounds, sink, what) -> tuple:
    """Split-K partials of attention over `scores` (H, S) and `values` (H, S, D), keys cut at
    `bounds` (an empty split: lse -inf, output 0): (partial_out (P, H, D), partial_lse (P, H),
    sink (H,), what, the exact answer: the sink softmax over all keys, times the values)."""
    splits = len(bounds) - 1
    heads, _, head_dim = values.shape
    partial_out, partial_lse = np.zeros((splits, heads, head_dim)), np.full((splits, heads), -_INF)
    for p in range(splits):
        chunk = slice(bounds[p], bounds[p + 1])
        if bounds[p + 1] > bounds[p]:
            top = scores[:, chunk].max(axis=1, keepdims=True)  # (H, 1)
            weights = np.exp(scores[:, chunk] - top)  # (H, s)
            total = weights.sum(axis=1)  # (H,)
            partial_lse[p] = top[:, 0] + np.log(total)
            partial_out[p] = np.einsum("hs,hsd->hd", weights / total[:, None], values[:, chunk])
    exact = np.einsum("hs,hsd->hd", answers.sink_softmax(scores, sink), values)  # (H, D)
    return partial_out, partial_lse, sink, what, exact


def _merge_cases() -> list:
    rng = np.random.default_rng(17)

    def case(scores, bounds, sink, what, head_dim=2):
        scores = _rows(scores)
        values = rng.normal(size=(*scores.shape, head_dim))
        return _split_case(scores, values, bounds, _rows(sink), what)

    return [
        case([[0.0, 1.0, -1.0, 2.0]], [0, 2, 4], [0.0], "two splits"),
        case([[1.0, 2.0, 0.5]], [0, 3], [1.0], "one split"),
        case([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], [1, 0, 1, 0, 1, 0, 1, 0]],
             [0, 2, 4, 6, 8], [0.5, -1.0], "four splits, two heads"),
        case([[0.5, 1.5, -0.5, 2.5, 0.0]], [0, 3, 3, 5], [1.0], "an empty split (lse -inf, output "
             "0), as a short sequence leaves"),
        case([[0.5, 1.5, -0.5, 2.5, 0.0]], [0, 0, 0, 3, 5], [1.0], "the first two splits empty"),
        case([[1000.0, 999.0, 1001.0], [-1000.0, -1001.0, -999.0]], [0, 1, 3], [1000.0, -1000.0],
             "heads at opposite ends: each head's own maximum subtracted"),
        case([[1000.0, 999.0, 998.5, 1001.0]], [0, 2, 4], [1000.2], "scores near 1000: exp(lse) "
             "overflows"),
        case([[-1000.0, -1001.0, -999.0]], [0, 1, 3], [-1000.0], "scores and sink near -1000"),
        case([[0.0, 1.0, 2.0]], [0, 1, 3], [-1000.0], "a sink far below: a plain merge"),
        case([[0.0, 1.0, 0.5, -0.5]], [0, 2, 4], [40.0], "a sink far above: an output near 0"),
        case([[1.0, 0.0, 2.0, 1.0, 0.0, 3.0], [0.0] * 6, [2.0, 2.0, 1.0, 0.0, -1.0, 0.0]],
             [0, 2, 4, 6], [0.0, 1.0, -2.0], "3 splits, 3 heads, 3 sinks", head_dim=3),
    ]  # fmt: skip


_MERGE_CASES = _merge_cases()


def _random_merge_case(rng) -> tuple:
    """P from 1 to 8 splits of S = 1 to 40 keys (a split may be empty, never all), H from 1 to 4,
    D from 1 to 8; scores as question 3's (no mask), the sink near, above or below them."""
    heads, head_dim, keys = (
        int(rng.integers(1, 5)),
        int(rng.integers(1, 9)),
        int(rng.integers(1, 41)),
    )
    spread = float(rng.choice([0.1, 1.0, 10.0]))
    offset = rng.choice(np.array([0.0, 0.0, 500.0, -500.0, 1000.0, -1000.0]), size=heads)
    scores = offset[:, None] + spread * rng.normal(size=(heads, keys))
    sink = offset + {"near": spread * rng.normal(size=heads), "above": rng.uniform(5, 40, heads),
                     "below": -rng.uniform(5, 40, heads)}[str(rng.choice(["near", "above",
                                                                         "below"]))]  # fmt: skip
    cuts = sorted(int(c) for c in rng.integers(0, keys + 1, size=int(rng.integers(0, 8))))
    values = rng.normal(size=(heads, keys, head_dim))
    return _split_case(scores, values, [0, *cuts, keys], sink, f"a random case ({len(cuts) + 1} "
                       f"splits, H = {heads})")  # fmt: skip


@question(function="merge_with_sink")
def test_merge_with_sink(submission: Submission) -> None:
    merge_with_sink = submission.function("merge_with_sink")
    rng = submission.rng()
    cases = [*submission.fixed(_MERGE_CASES), *(_random_merge_case(rng) for _ in range(6))]
    for partial_out, partial_lse, sink, what, _ in cases:
        expected = answers.sink_merge(partial_out, partial_lse, sink)
        shown = f"P = {partial_lse.shape[0]}, H = {len(sink)}, D = {partial_out.shape[2]}"
        if partial_lse.size <= 6:
            shown += f", lse {_numbers(partial_lse)}, sink {_numbers(sink)}"
        args = (partial_out.copy(), partial_lse.copy(), sink.copy())
        got = answer_of(merge_with_sink, args, f"{what} ({shown})")
        _float64_array(got, expected.shape, "merge_with_sink")
        # the terms' own size bounds the round-off of any order of summation
        scale = answers.sink_merge(np.abs(partial_out), partial_lse, sink) + 1e-300
        close = np.all(np.abs(got - expected) <= 1e-9 * scale)
        mistakes = {  # named within the check's own tolerance: in units of the terms' size
            name: lambda answer=answer: answer() / scale
            for name, answer in answers.sink_merge_mistakes(partial_out, partial_lse, sink).items()
        }
        with naming_mistakes(got / scale, mistakes, expected=expected / scale, rtol=0, atol=1e-9):
            assert close, (
                f"{what} ({shown}): expected {_numbers(expected)}, got {_numbers(got)} (sum_p "
                "exp(lse_p - L) out_p, L = log(exp(sink) + sum_p exp(lse_p)): the sink once, "
                "the largest of lse and sink subtracted before exp)"
            )


# --- question 5: a hybrid model's cache bytes ---------------------------------------------------


def _full(kv_heads: int, head_dim: int) -> dict:
    return {"kind": "full", "num_kv_heads": kv_heads, "head_dim": head_dim}


def _sliding(kv_heads: int, head_dim: int, window: int) -> dict:
    return {"kind": "sliding", "num_kv_heads": kv_heads, "head_dim": head_dim, "window": window}


def _linear(state_elements: int) -> dict:
    return {"kind": "linear", "state_elements": state_elements}


def _gpt_oss() -> list[dict]:  # gpt-oss-20b's config: sliding (128) and full, alternating
    return [_sliding(8, 64, 128) if i % 2 == 0 else _full(8, 64) for i in range(24)]


def _jamba() -> list[dict]:  # Jamba v0.1's: attention every 8th layer, Mamba (8192 x (4 + 16))
    return [_full(8, 128) if i % 8 == 4 else _linear(163_840) for i in range(32)]


def _gemma3() -> list[dict]:  # Gemma 3 27B's: five sliding (1024) layers, then a full one
    return [_full(16, 128) if (i + 1) % 6 == 0 else _sliding(16, 128, 1024) for i in range(62)]


def _three_to_one() -> list[dict]:  # three linear-attention layers, then a full one
    return [_full(2, 256) if i % 4 == 3 else _linear(548_864) for i in range(48)]


_HYBRID_CASES = [  # (layers, seq_len, bytes_per_element, what)
    ([_sliding(8, 64, 512), _full(2, 128), _linear(1000)], 600, 2,
     "each kind its own geometry, 600 tokens"),
    (_gpt_oss(), 100, 2, "gpt-oss-20b's layers, 100 tokens (below its window)"),
    (_gpt_oss(), 131_072, 2, "gpt-oss-20b's layers, 131,072 tokens"),
    (_gpt_oss(), 128, 2, "gpt-oss-20b's layers, 128 tokens (exactly the window)"),
    (_gpt_oss(), 129, 2, "gpt-oss-20b's layers, 129 tokens (one past the window)"),
    (_gemma3(), 1023, 2, "Gemma 3 27B's layers, 1023 tokens"),
    (_gemma3(), 32_768, 2, "Gemma 3 27B's layers, 32,768 tokens"),
    (_jamba(), 1, 2, "Jamba v0.1's layers, 1 token"),
    (_jamba(), 262_144, 2, "Jamba v0.1's layers, 262,144 tokens"),
    (_three_to_one(), 4096, 2, "3 linear-attention layers to 1 full, 4096 tokens"),
    ([_linear(4096)] * 4, 1_000_000, 4, "linear layers only, a million tokens"),
    ([_sliding(4, 32, 1), _full(4, 32)], 5, 1, "window 1, 5 tokens"),
    ([_sliding(1, 16, 8), _sliding(2, 16, 16)], 12, 2, "two windows, 12 tokens between them"),
    ([_full(8, 128)], 600_000, 4, "one layer past 2**31 bytes: no 32-bit product"),
]  # fmt: skip


def _random_hybrid_case(rng) -> tuple:
    """1 to 10 layers of random kinds and geometry (H_kv 1 to 8, D 16 to 128, one or two windows
    from 1 to 4096, states of 1 to 600,000 elements), 1, 2 or 4 bytes; seq_len 1, or below, at, one
    past or well past a window, or up to a million."""
    windows = [int(w) for w in rng.choice([1, 2, 8, 100, 128, 1024, 4096], size=2)]
    layers = []
    for _ in range(int(rng.integers(1, 11))):
        kind = str(rng.choice(["full", "sliding", "linear"]))
        heads, head_dim = int(rng.choice([1, 2, 4, 8])), int(rng.choice([16, 64, 80, 128]))
        if kind == "full":
            layers.append(_full(heads, head_dim))
        elif kind == "sliding":
            layers.append(_sliding(heads, head_dim, int(rng.choice(windows))))
        else:
            layers.append(_linear(int(rng.integers(1, 600_001))))
    window = int(rng.choice(windows))
    kind = str(rng.choice(["one", "below", "at", "past", "well past", "any"]))
    seq_len = {"one": 1, "below": max(1, window - int(rng.integers(1, 3))), "at": window,
               "past": window + 1, "well past": window * int(rng.integers(2, 9)),
               "any": int(rng.integers(1, 1_000_001))}[kind]  # fmt: skip
    what = f"a random case, {seq_len} tokens ({kind} window {window})"
    return layers, seq_len, int(rng.choice([1, 2, 4])), what


def _runs(names: list[str]) -> str:
    runs: list[list] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(name if count == 1 else f"{count} x {name}" for name, count in runs)


def _describe(layers: list[dict]) -> str:
    """Layers in runs, a repeated pattern once: `12 x [sliding(H_kv=8, D=64, W=128), full(H_kv=8,
    D=64)]`, what is left of a last repetition after it."""
    names = []
    for layer in layers:
        fields = ", ".join(f"{k}={v}" for k, v in layer.items() if k != "kind")
        names.append(f"{layer['kind']}({fields})")
    period = next(p for p in range(1, len(names) + 1)
                  if all(name == names[i % p] for i, name in enumerate(names)))  # fmt: skip
    repeats, rest = divmod(len(names), period)
    if period == 1 or repeats == 1:
        text = _runs(names)
    else:
        text = f"{repeats} x [{_runs(names[:period])}]"
        text += f", then {_runs(names[:rest])}" if rest else ""
    text = text.replace("num_kv_heads", "H_kv").replace("head_dim", "D").replace("window", "W")
    return text if len(text) <= 200 else text[:197] + "..."


@question(function="hybrid_cache_bytes")
def test_hybrid_cache_bytes(submission: Submission) -> None:
    hybrid_cache_bytes = submission.function("hybrid_cache_bytes")
    rng = submission.rng()
    cases = [*submission.fixed(_HYBRID_CASES), *(_random_hybrid_case(rng) for _ in range(6))]
    for layers, seq_len, bytes_per_element, what in cases:
        expected = answers.hybrid_bytes(layers, seq_len, bytes_per_element)
        case = f"{what}, {bytes_per_element} bytes per element"
        sent = [dict(layer) for layer in layers]
        got = answer_of(hybrid_cache_bytes, (sent, seq_len, bytes_per_element), case)
        expect_int(got, "hybrid_cache_bytes")
        kinds = answers.bytes_by_kind(layers, seq_len, bytes_per_element)
        split = " + ".join(f"{kind} {value:,}" for kind, value in kinds.items())
        mistakes = answers.hybrid_mistakes(layers, seq_len, bytes_per_element)
        with naming_mistakes(got, mistakes, expected=expected):
            assert got == expected, (
                f"{case}: expected {expected:,} bytes ({split}), got {got:,}; layers "
                f"{_describe(layers)}"
            )
