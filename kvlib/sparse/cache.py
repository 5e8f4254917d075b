"""Query-aware sparse attention over the paged cache (Quest; Tang et al., ICML 2024): keep every
token, read a few pages per decode step.

`SparsePagedCache` is chapter 7's paged cache with chapter 15's page bounds
(`kvlib.cache.paged_bounds.PageBoundsCache`) and its own attention backend. At each decode step
(one new token per sequence), in every layer past the first `dense_layers`, for each sequence:

1. score its pages: Quest's bound (`kvlib.sparse.bounds`, per KV head; one block table serves
   every KV head of the layer, so a page's score is the sum of its bounds over the KV heads:
   chapter 15 measures it against the largest), or for comparison the true
   attention mass (`selector="oracle"`) or random scores (`selector="random"`,
   `kvlib.sparse.baselines`);
2. keep the `budget_pages` best, the first page (attention sinks) and the newest (the query's
   own key) always among them (`kvlib.sparse.selection.select_pages`);
3. attend through chapter 11's kernel, `kvlib.kernels.paged_decode_attention`, handing it a
   compacted block table of the selected pages and their length
   (`kvlib.sparse.selection.compact_block_tables`). The kernel is unchanged: it reads whichever
   blocks a table names, so a shorter table is a shorter read. Compiled on a GPU, under Triton's
   interpreter on a CPU; `decode_attention="torch"` hands the same tables to chapter 7's
   plain-torch `paged_attention` instead (machines without Triton, and sweeps far too long for
   the interpreter, which runs each of the kernel's programs in Python).

Prefill and chunks of several tokens attend densely (`kvlib.cache.paged.paged_attention`), as in
Quest, which selects pages for decode queries only; so do the first `dense_layers` layers (Quest
keeps its first two layers dense, where attention is spread too evenly for a few pages to hold it;
chapter 15 measures it).

The cache counts what decode steps read (`read_counts`): K/V tokens read, K/V tokens held, and page
bounds read (each the size of one token's key and value: 2 · D per KV head).

Not done here: padding-free batching of the kernel's splits (the kernel's default split count),
sliding-window models (the kernel has no window), a per-KV-head selection (one table per sequence
and layer), and selection for prefill queries. Layouts: q (B, H, T, D); the pools and bounds as
`PageBoundsCache`'s.
"""

from __future__ import annotations

import torch

from kvlib import kernels  # first: without CUDA it sets TRITON_INTERPRET=1 before Triton loads
from kvlib._validate import check_positive_int
from kvlib.cache.paged import PagedKV, paged_attention
from kvlib.cache.paged_bounds import PageBoundsCache, PageBoundsKV
from kvlib.sparse.baselines import attention_mass_per_page, random_page_scores
from kvlib.sparse.bounds import quest_page_scores
from kvlib.sparse.selection import compact_block_tables, select_pages

__all__ = ["DECODE_ATTENTION", "SELECTORS", "SparsePagedCache"]

SELECTORS = ("quest", "oracle", "random")
DECODE_ATTENTION = ("kernel", "torch")


class SparsePagedCache(PageBoundsCache):
    """A paged cache whose decode steps read `budget_pages` pages per sequence and layer (see the
    module docstring).

    Args:
        num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device: as
            `kvlib.cache.PagedCache` (block_size a power of two, as the kernel needs).
        budget_pages: pages each decode step reads per sequence in a sparse layer (None: every
            page, dense).
        dense_layers: the first layers, which always attend densely.
        selector: "quest" (the page bound), "oracle" (true attention mass) or "random".
        sink_pages, recent_pages: pages always read at the start and at the end.
        decode_attention: "kernel" (`kvlib.kernels.paged_decode_attention`) or "torch"
            (`kvlib.cache.paged.paged_attention` over the same compacted tables).
        seed: of the random selector.
    Raises:
        ValueError: an unknown selector or decode attention, a budget below the forced pages, a
        block size that is not a power of two; as `PagedCache` otherwise.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        budget_pages: int | None = None,
        dense_layers: int = 2,
        selector: str = "quest",
        sink_pages: int = 1,
        recent_pages: int = 1,
        decode_attention: str = "kernel",
        seed: int = 0,
        **paged,
    ):
        super().__init__(num_layers, num_kv_heads, head_dim, **paged)
        if selector not in SELECTORS:
            raise ValueError(f"selector: expected one of {SELECTORS}, got {selector!r}")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"decode_attention: expected one of {DECODE_ATTENTION}, got {decode_attention!r}"
            )
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size: expected a power of two (the kernel's), got {self.block_size}"
            )
        self.sink_pages = check_positive_int("sink_pages", sink_pages, allow_zero=True)
        self.recent_pages = check_positive_int("recent_pages", recent_pages)
        if budget_pages is not None:
            check_positive_int("budget_pages", budget_pages)
            if budget_pages < self.sink_pages + self.recent_pages:
                raise ValueError(
                    f"budget_pages: expected at least sink_pages + recent_pages = "
                    f"{self.sink_pages + self.recent_pages}, got {budget_pages}"
                )
        self.budget_pages = budget_pages
        self.dense_layers = check_positive_int("dense_layers", dense_layers, allow_zero=True)
        self.selector, self.decode_attention = selector, decode_attention
        self.generator = torch.Generator().manual_seed(seed)
        # decode steps, summed over layers and sequences: K/V tokens read, held, bounds read
        self._counts = torch.zeros(3, dtype=torch.int64, device=self.key_cache[0].device)

    @classmethod
    def for_model(cls, model, num_sequences: int, max_seq_len: int, **options):
        """As `PagedCache.for_model`, refusing a sliding-window model (the kernel reads every
        token of the table it is given)."""
        if model.config.sliding_window is not None:
            raise ValueError(
                "model: a sliding-window model needs a windowed decode kernel; "
                "SparsePagedCache attends with a kernel that has none"
            )
        return super().for_model(model, num_sequences, max_seq_len, **options)

    def read_counts(self) -> dict[str, int]:
        """What decode steps have read so far, summed over layers and sequences: `kv_tokens_read`,
        `kv_tokens_held` (what dense attention would have read) and `bound_pages_read` (one page's
        bounds are the size of one token's K and V)."""
        read, held, bounds = self._counts.tolist()
        return {"kv_tokens_read": read, "kv_tokens_held": held, "bound_pages_read": bounds}

    def attention_backend(self, q, kv: PageBoundsKV, mask, *, weights_out=None) -> torch.Tensor:
        """q (B, H, T, D) -> (B, H, T, D): a decode step (T = 1) in a sparse layer reads the
        selected pages through the kernel; anything else is `paged_attention` (dense)."""
        decode = q.shape[2] == 1 and weights_out is None
        if not decode or self.budget_pages is None or kv.layer_idx < self.dense_layers:
            if decode:
                self._counts[:2] += kv.seq_lens.sum()  # dense: read everything held
            return paged_attention(q, kv, mask, weights_out=weights_out)
        tables, lens = self.select(q[:, :, 0], kv)
        return self._attend(q[:, :, 0], kv, tables, lens)[:, :, None]  # (B, H, 1, D)

    def select(self, q: torch.Tensor, kv: PageBoundsKV) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step's pages for each sequence: q (B, H, D) -> the compacted block tables
        (B, K) int32 and lengths (B,) int32 that `paged_decode_attention` reads."""
        seq_lens, block_size = kv.seq_lens, self.block_size
        num_pages = (seq_lens + block_size - 1) // block_size  # (B,)
        table_width = kv.block_tables.shape[1]
        if self.selector == "quest":
            scores = quest_page_scores(q, kv.key_min, kv.key_max, kv.block_tables)  # (B, P)
        elif self.selector == "oracle":
            mass = attention_mass_per_page(q, kv.key_cache, kv.block_tables, seq_lens)
            scores = mass.sum(dim=1)  # (B, P): the mass over all the layer's heads
        else:
            scores = random_page_scores(q.shape[0], table_width, self.generator, q.device)
        selected = select_pages(
            scores,
            num_pages,
            self.budget_pages,
            sink_pages=self.sink_pages,
            recent_pages=self.recent_pages,
        )
        tables, lens = compact_block_tables(
            kv.block_tables, seq_lens, selected, block_size, self.budget_pages, validate=False
        )
        self._counts[0] += lens.sum()
        self._counts[1] += seq_lens.sum()
        if self.selector == "quest":  # a sequence with no more pages than the budget needs none
            self._counts[2] += torch.where(num_pages > self.budget_pages, num_pages, 0).sum()
        return tables, lens

    def _attend(self, q, kv, tables, lens) -> torch.Tensor:
        """q (B, H, D) over the compacted tables, through the kernel, or through chapter 7's
        torch reference `paged_attention` over the same tables (`decode_attention="torch"`)."""
        if self.decode_attention == "kernel":
            return kernels.paged_decode_attention(
                q, kv.key_cache, kv.value_cache, tables, lens, validate=False
            )  # (B, H, D)
        slots = torch.arange(tables.shape[1] * self.block_size, device=q.device)  # (K · bs,)
        positions = slots.expand(tables.shape[0], -1)  # (B, K · bs): every slot of each table
        compacted = PagedKV(kv.key_cache, kv.value_cache, tables.long(), lens.long(), positions)
        mask = (slots < lens[:, None])[:, None]  # (B, 1, K · bs): the tokens each table holds
        return paged_attention(q[:, :, None], compacted, mask)[:, :, 0]  # (B, H, D)
