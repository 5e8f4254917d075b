"""Which pages a decode step reads: top-k page selection with forced pages, and the compacted block
table that hands the selection to chapter 11's kernel (Quest; Tang et al., ICML 2024).

- `select_pages`: per sequence, the `budget` pages of highest score, with the first `sink_pages`
  (the attention sinks of StreamingLLM, Xiao et al., ICLR 2024, live in the first tokens) and the
  last `recent_pages` (the newest page, partly filled, holds the query's own key and its nearest
  neighbours) always among them. Forcing the first page in is this course's addition (chapter
  8's attention sinks). Quest's kernel path forces the newest page and ranks the others by their
  bounds (`decode_estimate` scores every page but the last); its accuracy harness
  (`evaluation/quest_attention.py`, github.com/mit-han-lab/Quest at commit 24c9c6f) ranks every
  chunk, the newest included, keeping the top max(3, budget // chunk): `recent_pages=0`.
- `compact_block_tables`: the selected pages' physical blocks, in logical order, as a shorter
  block table, and the length that table holds. The selection is metadata: nothing is copied,
  the kernel reads the blocks where they are. Every selected page but the newest is full, so the
  compacted length is `(count - 1) · block_size + the newest page's fill`.

Per sequence, not per head: one block table serves every KV head of a layer (the kernel's
interface, `paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)`), so the scores
passed here are already reduced over heads (`kvlib.sparse.cache` sums the KV heads' bounds).

Layouts: scores (B, P) float, P = the widest block table's pages; selected (B, P) bool; block
tables (B, P) and compacted (B, K) integer, K <= budget; lengths (B,).
"""

from __future__ import annotations

import torch

from kvlib._validate import check_positive_int

__all__ = ["compact_block_tables", "select_pages"]


def select_pages(
    scores: torch.Tensor,
    num_pages: torch.Tensor,
    budget: int,
    *,
    sink_pages: int = 1,
    recent_pages: int = 1,
) -> torch.Tensor:
    """Top-k pages per sequence, the sink and newest pages forced in.

    Args:
        scores: (B, P) float: a page's priority (Quest's bound, the true attention mass, ...);
            entries at or past a sequence's page count are ignored.
        num_pages: (B,) integer, pages each sequence holds, each in [1, P].
        budget: pages to read per sequence, >= sink_pages + recent_pages (a sequence with fewer
            pages reads all of them).
        sink_pages, recent_pages: pages always read at the start and at the end (>= 0).
    Returns:
        (B, P) bool: True where sequence b reads page p; `min(budget, num_pages[b])` per row.
    Raises:
        ValueError: shapes that disagree, or a budget below the forced pages.
    """
    budget = check_positive_int("budget", budget)
    sink_pages = check_positive_int("sink_pages", sink_pages, allow_zero=True)
    recent_pages = check_positive_int("recent_pages", recent_pages, allow_zero=True)
    if budget < sink_pages + recent_pages:
        raise ValueError(
            f"budget: expected at least sink_pages + recent_pages = {sink_pages + recent_pages} "
            f"pages (they are always read), got {budget}"
        )
    if scores.dim() != 2 or num_pages.shape != scores.shape[:1]:
        raise ValueError(
            "scores, num_pages: expected (B, P) and (B,), got "
            f"{tuple(scores.shape)} and {tuple(num_pages.shape)}"
        )
    pages = torch.arange(scores.shape[1], device=scores.device)  # (P,)
    counts = num_pages.to(scores.device)[:, None]  # (B, 1)
    held = pages < counts  # (B, P)
    forced = (pages < sink_pages) | (pages >= counts - recent_pages)  # (B, P)
    priority = scores.masked_fill(forced, float("inf")).masked_fill(~held, float("-inf"))
    top = priority.topk(min(budget, scores.shape[1]), dim=1).indices  # (B, k)
    chosen = torch.zeros_like(held).scatter_(1, top, True)
    return chosen & held  # (B, P)


def compact_block_tables(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: torch.Tensor,
    block_size: int,
    width: int,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table and length of each sequence's selected pages, for
    `kvlib.kernels.paged_decode_attention`.

    Args:
        block_tables: (B, P) integer, the sequences' full block tables.
        seq_lens: (B,) integer, the tokens each sequence holds.
        selected: (B, P) bool, the pages to read (`select_pages`), the newest page of every
            sequence among them.
        block_size: tokens per page.
        width: columns of the compacted table, at least every row's selected count (the budget;
            at most P are kept).
        validate: check the rows' counts and newest pages (one host sync; `select_pages`'s
            output passes, so a decode loop that just called it skips the check).
    Returns:
        (tables, lens): (B, min(width, P)) int32, the selected pages' blocks in logical order
        (entries past a row's count are 0), and (B,) int32, `(count - 1) · block_size` plus the
        newest page's fill.
    Raises:
        ValueError: shapes that disagree; with `validate`, a row with more selected pages than
        `width` or without its newest page.
    """
    block_size = check_positive_int("block_size", block_size)
    width = check_positive_int("width", width)
    if selected.shape != block_tables.shape or seq_lens.shape != block_tables.shape[:1]:
        raise ValueError(
            "block_tables, seq_lens, selected: expected (B, P), (B,) and (B, P), got "
            f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, {tuple(selected.shape)}"
        )
    pages = torch.arange(block_tables.shape[1], device=block_tables.device)  # (P,)
    lens = seq_lens.long()
    newest = (lens + block_size - 1) // block_size - 1  # (B,) the last page, partly filled
    count = selected.sum(dim=1)  # (B,)
    if validate:
        has_newest = selected.gather(1, newest[:, None])[:, 0]
        if not bool((has_newest & (count <= width)).all()):
            raise ValueError(
                f"selected: expected every row to hold its newest page and at most width = "
                f"{width} pages, got counts {count.tolist()} and newest pages selected "
                f"{has_newest.tolist()}"
            )
    # selected pages first, in logical order: a stable sort on (not selected, page)
    order = torch.where(selected, pages, pages + block_tables.shape[1]).argsort(dim=1)
    order = order[:, :width]  # (B, K), K = min(width, P)
    tables = block_tables.gather(1, order)
    columns = torch.arange(order.shape[1], device=pages.device)  # (K,)
    tables = tables.masked_fill(columns >= count[:, None], 0)
    fill = lens - newest * block_size  # (B,) tokens in the newest page, 1..block_size
    return tables.int(), ((count - 1) * block_size + fill).int()  # (B, K), (B,)
