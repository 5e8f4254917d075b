"""Chapter 15's graded questions: Quest's page bound over a GQA group, the pages one decode step
reads (one table for every KV head, the sink and newest pages forced in), the compacted block table
and its length, and the bytes a sparse decode step reads. Oracles: `kvlib.sparse`'s bound,
selection and compaction and `kvlib.memory.sparse` (every answer is written without kvlib)."""

from __future__ import annotations

import math

import torch

from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import (
    Submission,
    expect_int,
    expect_list,
    expect_tensor,
    is_int,
    question,
)
from kvlib.memory.sparse import sparse_decode_read_bytes
from kvlib.sparse.bounds import page_upper_bounds
from kvlib.sparse.selection import compact_block_tables, select_pages


def _bound(q, key_min, key_max, scale) -> torch.Tensor:
    """kvlib's bound for one group: q (G, D), pages (P, D) -> (P,)."""
    return page_upper_bounds(q[None], key_min[None, :, None], key_max[None, :, None], scale=scale)[
        0, 0
    ]


def _pages_box(rng, num_pages: int, head_dim: int, spread: float):
    """Random keys, 1 to 5 a page: their minima and maxima, (P, D) each."""
    keys = [
        torch.from_numpy(rng.normal(0.0, spread, size=(int(rng.integers(1, 6)), head_dim)))
        for _ in range(num_pages)
    ]
    return torch.stack([k.amin(0) for k in keys]), torch.stack([k.amax(0) for k in keys])


def _bound_mistakes(q, key_min, key_max, scale) -> dict:
    """page_bound's common mistakes: q (G, D), pages (P, D) -> (P,)."""
    corners = torch.maximum(q[:, None] * key_min[None], q[:, None] * key_max[None])  # (G, P, D)
    return {
        "q · max whatever the sign of q: where q_i < 0 the largest q_i · k_i is at the min": (
            lambda: scale * (q @ key_max.T).amax(dim=0)
        ),
        "the score of the box's centre, not the largest score in the box": lambda: (
            scale * (q @ ((key_min + key_max) / 2).T).amax(dim=0)
        ),
        "the group's mean query: bound each head, then take the largest": lambda: _bound(
            q.mean(dim=0, keepdim=True), key_min, key_max, scale
        ),
        "summed over the group's heads, not their largest": lambda: (
            scale * corners.sum(dim=-1).sum(dim=0)
        ),
        "the scale forgotten": lambda: _bound(q, key_min, key_max, 1.0),
    }


@question(function="page_bound")
def test_page_bound(submission: Submission) -> None:
    page_bound = submission.function("page_bound")
    rng = submission.rng()  # random cases are drawn afresh on every run
    d = torch.float64
    fixed = [
        (
            torch.tensor([[1.0, 2.0]], dtype=d),
            torch.tensor([[0.0, -1.0], [2.0, 0.5]], dtype=d),
            torch.tensor([[1.0, 1.0], [3.0, 0.5]], dtype=d),
            1.0,
            "one query head, two pages",
        ),
        (
            torch.tensor([[-1.0, 0.5, -2.0]], dtype=d),
            torch.tensor([[-1.0, -1.0, -1.0]], dtype=d),
            torch.tensor([[2.0, 1.0, 3.0]], dtype=d),
            0.5,
            "negative query coordinates (largest at the box's bottom)",
        ),
        (
            torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=d),
            torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=d),
            torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=d),
            1.0,
            "a group of two heads pointing opposite ways (their mean query scores 0)",
        ),
        (
            torch.tensor([[0.3, -0.7], [2.0, 1.0], [-0.5, 0.2]], dtype=d),
            torch.tensor([[0.5, -2.0]], dtype=d),
            torch.tensor([[0.5, -2.0]], dtype=d),
            0.125,
            "a page of one key (the box is a point: the bound is the best head's score)",
        ),
    ]
    cases = submission.fixed(fixed)
    for _ in range(3):
        group, head_dim = int(rng.choice([1, 2, 3, 4])), int(rng.choice([2, 8, 16]))
        spread = float(rng.choice([0.1, 1.0, 10.0]))
        key_min, key_max = _pages_box(rng, int(rng.integers(1, 7)), head_dim, spread)
        q = torch.from_numpy(rng.normal(0.0, spread, size=(group, head_dim)))
        cases.append((q, key_min, key_max, float(rng.choice([1.0, head_dim**-0.5])), "random"))
    for q, key_min, key_max, scale, what in cases:
        expected = _bound(q, key_min, key_max, scale)
        got = page_bound(q.clone(), key_min.clone(), key_max.clone(), scale)
        expect_tensor(got, expected, "page_bound")
        low = (got < expected - 1e-9 * (1 + expected.abs())).nonzero()  # Quest's is tight
        with naming_mistakes(got, _bound_mistakes(q, key_min, key_max, scale)):
            assert not len(low), (
                f"{what}: not an upper bound: in page {int(low[0, 0])}'s box (each coordinate "
                f"between the page's min and max) a key can score "
                f"{float(expected[low[0, 0]]):.6g} for some head of the group, above your "
                f"{float(got[low[0, 0]]):.6g}"
            )
            assert torch.allclose(got, expected, rtol=1e-9, atol=1e-12), (
                f"{what}: expected {[round(x, 6) for x in expected.tolist()]}, got "
                f"{[round(x, 6) for x in got.tolist()]}: Quest's bound is, for each page, the "
                "largest over the group's heads h of scale · Σ_i max(q_hi · min_i, q_hi · max_i)"
            )


def _selection(head_bounds, group_size, num_pages, budget, *, interleaved=False) -> list[int]:
    num_heads, width = head_bounds.shape
    if interleaved:  # a mistake: KV head j's group taken as query heads j, j + H_kv, ...
        per_kv_head = head_bounds.view(group_size, num_heads // group_size, width).amax(dim=0)
    else:
        per_kv_head = head_bounds.view(num_heads // group_size, group_size, width).amax(dim=1)
    scores = per_kv_head.sum(dim=0)[None]  # (1, P)
    selected = select_pages(scores, torch.tensor([num_pages]), budget)[0]
    return selected.nonzero()[:, 0].tolist()


def _random_selection_case(rng) -> tuple:
    group = int(rng.choice([1, 2, 3]))
    num_kv_heads = int(rng.choice([1, 2, 3]))
    num_pages = int(rng.integers(1, 20))
    width = num_pages + int(rng.integers(0, 4))  # the batch's widest table may be wider
    bounds = torch.from_numpy(rng.normal(0.0, 2.0, size=(group * num_kv_heads, width)))
    return bounds, group, num_pages, int(rng.integers(2, 9)), "a random case"


@question(function="pages_to_read")
def test_pages_to_read(submission: Submission) -> None:
    pages_to_read = submission.function("pages_to_read")
    rng = submission.rng()
    d = torch.float64
    fixed = [
        (
            torch.tensor([[0.0, 6.0, 4.0, 4.0, 0.0], [0.0, 0.0, 4.0, 3.5, 0.0]], dtype=d),
            1,
            5,
            3,
            "two KV heads (group size 1): page 2 is wanted by both, page 1 by one (sum them)",
        ),
        (
            torch.tensor(
                [[0.0, 5.0, 3.0, 0.0], [0.0, 0.0, 3.0, 0.0], [0.0, 0.0, 3.0, 0.0]], dtype=d
            ),
            3,
            4,
            3,
            "one KV head, a group of three: the bound is the group's largest, not its sum",
        ),
        (
            torch.tensor([[-5.0, 3.0, 2.0, 1.0, -5.0, 9.0]], dtype=d),
            1,
            5,
            3,
            "the sink (page 0) and the newest page (num_pages - 1, not the last column) are "
            "always read, whatever their scores",
        ),
        (
            torch.tensor(
                [
                    [0.0, 3.0, 0.0, 0.0, 0.0],
                    [0.0, 3.0, 0.0, 0.0, 0.0],
                    [0.0, 0.0, 4.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0, 0.0, 0.0],
                ],
                dtype=d,
            ),
            2,
            5,
            3,
            "two KV heads, groups of two: query heads 0 and 1 share KV head 0, heads 2 and 3 KV "
            "head 1 (consecutive, not interleaved)",
        ),  # fmt: skip
        (torch.tensor([[1.0, 2.0, 3.0]], dtype=d), 1, 3, 8, "fewer pages than the budget"),
        (torch.tensor([[4.0, 1.0]], dtype=d), 1, 1, 2, "a sequence of one page"),
    ]
    cases = [*submission.fixed(fixed), *(_random_selection_case(rng) for _ in range(6))]
    for bounds, group, num_pages, budget, what in cases:
        expected = _selection(bounds, group, num_pages, budget)
        got = pages_to_read(bounds.clone(), group, num_pages, budget)
        expect_list(
            got,
            is_int,
            "pages_to_read should return a list of ints (logical page indices)",
        )
        assert len(got) == len(expected), (
            f"{what}: {num_pages} pages, budget {budget}: expected min(budget, num_pages) pages "
            f"= {len(expected)} (the sink and newest pages count towards the budget), got "
            f"{len(got)}: {got}"
        )
        assert got == sorted(got), f"{what}: return the pages in ascending order, got {got}"
        shown = "" if bounds.numel() > 15 else f", bounds {bounds.tolist()}"
        mistakes = {
            "interleaved groups: KV head j's group is query heads j·G .. j·G + G - 1 "
            "(consecutive), not j, j + H_kv, j + 2·H_kv": lambda: _selection(
                bounds, group, num_pages, budget, interleaved=True
            ),
            "each page's largest bound over every query head, not the sum over KV heads of "
            "each group's largest": lambda: _selection(bounds, len(bounds), num_pages, budget),
            "the sum over every query head, not over KV heads of each group's largest": lambda: (
                _selection(bounds, 1, num_pages, budget)
            ),
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"{what}: expected pages {expected}, got {got} ({num_pages} pages, budget "
                f"{budget}, group size {group}{shown}; a KV head's bound is its group's largest, "
                "a page's score the sum over KV heads; pages 0 and num_pages - 1 are always read, "
                "then the highest scores: min(budget, num_pages) pages, ascending)"
            )


def _compacted(block_table, seq_len, pages, block_size) -> tuple[list[int], int]:
    width = len(block_table)
    selected = torch.zeros(1, width, dtype=torch.bool)
    selected[0, list(pages)] = True
    tables, lens = compact_block_tables(
        torch.tensor([block_table]), torch.tensor([seq_len]), selected, block_size, len(pages)
    )
    return tables[0].tolist(), int(lens[0])


def _compaction_mistakes(block_table, seq_len, pages, block_size) -> dict:
    """compact_table's common mistakes, the first from the chapter's pitfall 2 (b)."""
    blocks = [block_table[p] for p in sorted(pages)]
    full = (len(pages) - 1) * block_size
    fill = seq_len - (math.ceil(seq_len / block_size) - 1) * block_size
    return {
        "the newest page counted full: it holds seq_len - (num_pages - 1) · block_size tokens": (
            lambda: (blocks, full + block_size)
        ),
        "the newest page's fill as seq_len % block_size: a full newest page holds block_size, "
        "not 0": lambda: (blocks, full + seq_len % block_size),
        "the blocks in the order the pages were given: the table is in logical order": lambda: (
            [block_table[p] for p in pages],
            full + fill,
        ),
    }


def _random_compaction_case(rng) -> tuple:
    block_size = int(rng.choice([1, 4, 16]))
    num_pages = int(rng.integers(1, 12))
    seq_len = int(rng.integers((num_pages - 1) * block_size + 1, num_pages * block_size + 1))
    table = [int(b) for b in rng.permutation(64)[:num_pages]]
    others = [int(p) for p in rng.permutation(num_pages - 1)[: int(rng.integers(0, num_pages))]]
    pages = [num_pages - 1] + others
    rng.shuffle(pages)
    return table, seq_len, pages, block_size, "a random case"


@question(function="compact_table")
def test_compact_table(submission: Submission) -> None:
    compact_table = submission.function("compact_table")
    rng = submission.rng()
    fixed = [
        ([7, 3, 9, 1], 53, [0, 2, 3], 16, "a partly filled newest page (5 of 16 tokens)"),
        ([7, 3, 9, 1], 64, [0, 3], 16, "a full newest page (64 tokens: 16, not 64 % 16 = 0)"),
        ([4, 8, 2], 40, [2, 0], 16, "pages given newest first: the table is in logical order"),
        ([5], 3, [0], 16, "one page of 3 tokens"),
        ([11, 12, 13, 14, 15], 9, [4, 1], 2, "physical blocks differ from logical pages"),
    ]
    cases = [*submission.fixed(fixed), *(_random_compaction_case(rng) for _ in range(5))]
    for table, seq_len, pages, block_size, what in cases:
        expected = _compacted(table, seq_len, pages, block_size)
        got = compact_table(list(table), seq_len, list(pages), block_size)
        assert isinstance(got, tuple) and len(got) == 2, (
            f"compact_table should return (blocks, length), got {got!r}"
        )
        blocks, length = got
        expect_list(
            blocks,
            is_int,
            "compact_table's blocks should be a list of ints (physical block ids)",
        )
        mistakes = _compaction_mistakes(table, seq_len, pages, block_size)
        with naming_mistakes((list(blocks), length), mistakes, expected=expected):
            assert list(blocks) == expected[0], (
                f"{what}: block table {table}, pages {pages}: expected the blocks {expected[0]} "
                f"(the selected pages' physical blocks, in logical order), got {blocks}"
            )
            assert is_int(length) and length == expected[1], (
                f"{what}: {seq_len} tokens in pages of {block_size}, pages {pages}: expected "
                f"length {expected[1]} (every selected page full but the newest, which holds "
                f"{seq_len - (math.ceil(seq_len / block_size) - 1) * block_size}), got "
                f"{length!r}"
            )


_DTYPES = {1: "int8", 2: "bfloat16", 4: "float32"}


def _read_bytes(layers, dense, kv_heads, head_dim, element_bytes, seq_len, block_size, budget):
    config = dict(
        model_type="llama",
        num_hidden_layers=layers,
        num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=kv_heads * head_dim,
        torch_dtype=_DTYPES[element_bytes],
    )
    return sparse_decode_read_bytes(
        config, seq_len, budget, block_size=block_size, dense_layers=dense
    )


def _read_formula(args, *, bounds=True, bounds_always=False, newest_full=False, dense_ok=True,
                  bound_tokens=1) -> int:  # fmt: skip
    """decode_read_bytes written out, its common mistakes switchable."""
    layers, dense, kv_heads, head_dim, element_bytes, seq_len, block_size, budget = args
    dense = dense if dense_ok else 0
    pages = -(-seq_len // block_size)
    fill = block_size if newest_full else seq_len - (pages - 1) * block_size
    page_bounds = pages * bound_tokens if bounds else 0
    if pages <= budget:
        sparse = seq_len + (page_bounds if bounds_always else 0)
    else:
        sparse = (budget - 1) * block_size + fill + page_bounds
    return (dense * seq_len + (layers - dense) * sparse) * 2 * kv_heads * head_dim * element_bytes


def _read_mistakes(args) -> dict:
    return {
        "no bounds read: a sparse layer reads every page's bounds to choose": lambda: _read_formula(
            args, bounds=False
        ),
        "bounds read although the sequence has at most budget pages (it reads them all, no "
        "choice to make)": lambda: _read_formula(args, bounds_always=True),
        "the newest page counted full: it holds S - (pages - 1) · block_size tokens": lambda: (
            _read_formula(args, newest_full=True)
        ),
        "no dense layers: the first `dense` layers read every token": lambda: _read_formula(
            args, dense_ok=False
        ),
        "bounds of D values per KV head: a page's min and max are 2 · D (one token's K and V)": (
            lambda: _read_formula(args, bound_tokens=0.5)
        ),
    }


@question(function="decode_read_bytes")
def test_decode_read_bytes(submission: Submission) -> None:
    decode_read_bytes = submission.function("decode_read_bytes")
    rng = submission.rng()
    fixed = [  # (L, dense layers, H_kv, D, b, S, block size, budget), what
        ((32, 2, 8, 128, 2, 131072, 16, 512), "Llama 3 8B at 128k tokens, 512 pages"),
        ((30, 2, 3, 64, 2, 440, 16, 4), "SmolLM2 on a 440-token essay (a partial newest page)"),
        ((30, 2, 3, 64, 2, 448, 16, 4), "448 tokens: a full newest page"),
        ((4, 1, 4, 32, 4, 50, 16, 4), "4 pages, budget 4: everything, no bounds to read"),
        ((4, 4, 4, 32, 4, 500, 16, 4), "every layer dense"),
        ((4, 0, 4, 32, 4, 500, 16, 4), "no dense layer"),
        ((4, 1, 4, 32, 1, 500, 8, 3), "int8 K/V, pages of 8"),
    ]
    cases = submission.fixed(fixed)
    for _ in range(3):
        layers = int(rng.integers(1, 40))
        block_size = int(rng.choice([4, 16, 32]))
        budget = int(rng.integers(2, 40))
        args = (
            layers,
            int(rng.integers(0, layers + 1)),
            int(rng.choice([1, 2, 8])),
            int(rng.choice([64, 128])),
            int(rng.choice([1, 2, 4])),
            int(rng.integers(1, 20_000)),
            block_size,
            budget,
        )
        cases.append((args, "a random case"))
    for args, what in cases:
        expected = _read_bytes(*args)
        got = decode_read_bytes(*args)
        expect_int(got, "decode_read_bytes")
        layers, dense, kv_heads, head_dim, element_bytes, seq_len, block_size, budget = args
        with naming_mistakes(got, _read_mistakes(args)):
            assert got == expected, (
                f"{what} (L={layers}, {dense} dense, H_kv={kv_heads}, D={head_dim}, "
                f"b={element_bytes}, S={seq_len}, pages of {block_size}, budget {budget}): "
                f"expected {expected:,} bytes, got {got:,}; a sparse layer reads (budget - 1) full "
                "pages + the newest page's tokens + every page's bounds (2 · D per KV head: one "
                "token's K and V); a dense layer, or a sequence of at most budget pages, reads its "
                "S tokens and no bounds"
            )
