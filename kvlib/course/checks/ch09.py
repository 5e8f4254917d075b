"""Chapter 9's graded questions: the blocks a sequence can free without moving anything, the
repack's gather and scatter, and the position map after a hole-filling round. Oracles: kvlib's
plans (`kvlib.cache.compaction_plans`)."""

from __future__ import annotations

import torch

from kvlib.cache.compaction_plans import freeable_blocks, plan_hole_filling, plan_repack
from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Submission, expect_int, expect_list, is_int, question


def _patterns(rng, fixed: bool = True):
    """(live, block_size, what) cases: the chapter's toy and edge cases (if `fixed`), random
    scatters drawn from `rng` (a numpy Generator, drawn afresh on every run)."""
    if fixed:
        yield from _fixed_patterns()
    for n in (17, 40, 63):
        keep = float(rng.uniform(0.1, 0.9))
        live = [bool(x) for x in rng.random(n) < keep]
        yield live, int(rng.choice((1, 2, 4, 8))), f"random, {n} slots"


def _fixed_patterns():
    yield [t not in (2, 9, 13, 21) for t in range(24)], 4, "the chapter's toy (T2, T9, T13, T21)"
    yield [not 4 <= t < 12 for t in range(20)], 4, "two whole blocks evicted"
    yield [t >= 16 for t in range(22)], 8, "the first 16 evicted, a partly filled last block"
    yield [False] * 6, 4, "everything evicted (a full and a partly filled block)"
    yield [True] * 9, 4, "nothing evicted"
    yield [t % 10 == 0 for t in range(160)], 16, "every 10th token kept"


@question(function="blocks_freeable")
def test_blocks_freeable(submission: Submission) -> None:
    blocks_freeable = submission.function("blocks_freeable")
    for live, block_size, what in _patterns(submission.rng(), submission.fixed_cases):
        expected = len(freeable_blocks(live, block_size))
        got = blocks_freeable(list(live), block_size)
        expect_int(got, "blocks_freeable")
        with naming_mistakes(got, _freeable_mistakes(live, block_size)):
            assert got == expected, (
                f"{what}: a block is freeable only when none of its slots holds a survivor (the "
                f"last block counts only the slots it has); expected {expected}, got {got} for "
                f"live={[int(x) for x in live][:24]}{'...' if len(live) > 24 else ''}, "
                f"block_size {block_size}"
            )


def _freeable_mistakes(live, block_size) -> dict:
    """blocks_freeable's common mistakes: `live` one bool per slot."""
    size, starts = block_size, range(0, len(live), block_size)
    return {
        "the blocks a compaction would free: without moving anything, a block is freeable only "
        "when none of its slots holds a survivor": lambda: (
            -(-len(live) // size) - -(-sum(live) // size)
        ),
        "the partly filled last block left out: it is freeable too when none of its slots holds "
        "a survivor": lambda: sum(
            not any(live[i * size : (i + 1) * size]) for i in range(len(live) // size)
        ),
        "every block with an evicted slot counted: a block is freeable only when all its slots "
        "are evicted": lambda: sum(not all(live[start : start + size]) for start in starts),
    }


@question(function="repack")
def test_repack(submission: Submission) -> None:
    repack = submission.function("repack")
    for live, _, what in _patterns(submission.rng(1), submission.fixed_cases):
        n = len(live)
        slots = torch.arange(n * 3, dtype=torch.float32).view(n, 3)  # row i: token i's K (say)
        original = slots.clone()
        survivors = [i for i in range(n) if live[i]]
        call = repack.call(slots, torch.tensor(live, dtype=torch.bool), _options={"mutates": {0}})
        got, slots = call.result, call.args[0]
        expected = len(plan_repack(live))
        assert isinstance(slots, torch.Tensor) and slots.shape == (n, 3), (
            f"{what}: rewrite `slots` in place (a cache has no second pool), keeping its shape"
        )
        rows, counts = _repack_mistakes(original, live)
        with naming_mistakes(slots[: len(survivors)], rows, rtol=0.0, atol=0.0):
            assert torch.equal(slots[: len(survivors)], original[survivors]), (
                f"{what}: after the repack the survivors must fill the first rows in their order; "
                f"expected rows {survivors[:12]}{'...' if len(survivors) > 12 else ''} first, "
                f"got {slots[: len(survivors), 0].div(3).long().tolist()[:12]} (read every "
                "source before writing any destination: a destination can be a later move's "
                "source)"
            )
        with naming_mistakes(got, counts):
            assert is_int(got) and got == expected, (
                f"{what}: return how many rows were copied (survivors whose row changed), "
                f"expected {expected}, got {got!r}"
            )


def _repack_mistakes(original: torch.Tensor, live) -> tuple[dict, dict]:
    """repack's common mistakes: for the first rows once it ran (as many as survivors), and for
    the count it returns."""
    kept = sum(live)

    def hole_filled():
        slots = original.clone()
        for src, dst in plan_hole_filling(live):
            slots[dst] = original[src]
        return slots[:kept]

    rows = {
        "the slots left as they were: write into `slots` itself (slots[...] = ...), not into a "
        "new tensor bound to its name": lambda: original[:kept],
        "hole-filling's moves (the last survivor into the first hole): a repack keeps the "
        "survivors in their order": hole_filled,
    }
    counts = {
        "every survivor counted: count only those whose row changed (those in front of the "
        "first hole stay)": lambda: kept,
        "the evicted slots counted: count the survivors whose row changed": lambda: (
            len(live) - kept
        ),
    }
    return rows, counts


def _positions_after(positions):
    live = [p >= 0 for p in positions]
    moved = list(positions)
    for src, dst in plan_hole_filling(live):
        moved[dst] = positions[src]
    return moved[: sum(live)]


@question(function="positions_after_hole_filling")
def test_positions_after_hole_filling(submission: Submission) -> None:
    positions_after = submission.function("positions_after_hole_filling")
    rng = submission.rng()
    cases = submission.fixed([
        ([p if p not in (2, 9, 13, 21) else -1 for p in range(24)], "the chapter's toy"),
        ([0, 1, -1, -1, 4, 5, 6, -1, 8], "holes next to each other"),
        ([0, 17, 2, -1, 4, 16, -1, 7, 8, 9, 15, 12], "a map already scrambled by an earlier round"),
        ([0, 1, 2, 3], "nothing evicted"),
        ([-1, -1, 5, 6], "holes only at the front"),
        ([0, 1, -1, -1], "holes only at the back"),
    ])  # fmt: skip
    for n in (int(rng.integers(1, 12)), 40):  # drawn afresh on every run
        scattered = [p if rng.random() < 0.6 else -1 for p in range(n)]
        cases.append((scattered, f"random, {n} slots"))
    scrambled = [int(p) for p in rng.permutation(30)]  # an earlier round left them out of order
    cases.append(([p if rng.random() < 0.6 else -1 for p in scrambled], "random, scrambled"))
    for positions, what in cases:
        expected = _positions_after(positions)
        got = positions_after(list(positions))
        expect_list(
            got,
            is_int,
            "positions_after_hole_filling should return a list of ints",
        )
        with naming_mistakes(got, _hole_filling_mistakes(positions)):
            assert got == expected, (
                f"{what}: the last survivor moves into the first hole, the one before it into the "
                "next hole, until no hole is in front of a survivor; then the map keeps one entry "
                f"per survivor; for {positions} expected {expected}, got {got}"
            )


def _hole_filling_mistakes(positions) -> dict:
    """positions_after_hole_filling's common mistakes: `positions` a map, -1 where evicted."""
    moved = list(positions)
    for src, dst in plan_hole_filling([p >= 0 for p in positions]):
        moved[dst] = positions[src]
    return {
        "the repack's map (the survivors in slot order): hole-filling moves the last survivor "
        "into the first hole": lambda: [p for p in positions if p >= 0],
        "the whole map returned: after the round the sequence keeps only as many slots as it has "
        "survivors": lambda: moved,
        "the -1 entries dropped from the whole map: a move copies, so a moved survivor's old slot "
        "still holds it; keep the first (number of survivors) slots": lambda: [
            p for p in moved if p >= 0
        ],
    }
