"""The paged KV cache (chapter 7): K/V in fixed-size blocks of one pool per layer, addressed
through per-sequence block tables (PagedAttention; Kwon et al., 2023, SOSP).

Layout per layer: `key_cache`, `value_cache` of shape `(num_blocks, block_size, H_kv, D)` (vLLM's,
and chapter 11's kernel's). A step's new tokens are written through the **slot mapping**
(`slot = block_table[t // block_size] * block_size + t % block_size`, flattened over the pool) and
read back by a **paged attention** that gathers each sequence's blocks in logical order
(`paged_attention`, the torch reference; chapter 11's Triton kernel reads the same layout).

Blocks come from `kvlib.cache.block_manager.BlockManager`: allocated as tokens arrive, shared by
`repeat` (parallel samples, beams: each block's reference count goes up instead of copying) and by
`reorder` (beam search keeps or drops beams by forking and freeing), and copied on write when a
sequence appends into a partly filled block it shares (the copies `BlockManager.copies` lists are
applied to every layer before the step writes).

**No padding is stored.** The model tells the cache which positions are padding
(`begin_forward`, before its first layer), and only real tokens get slots: a batch of prompts of
different lengths holds exactly their tokens (`seq_lens` differ per sequence). For the model's
left-padded view, the read maps every position of the batch to the sequence's token index
(`PagedKV.positions`); padding positions read the sequence's first token, which the mask hides.
The cache never sees token ids, so prefix caching (which hashes them) is the serving engine's job
(chapter 12).
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch

from kvlib._validate import check_positive_int
from kvlib.cache.base import check_kv_update, check_moves, check_truncate_length
from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool
from kvlib.errors import OutOfBlocksError
from kvlib.ops.attention import reference_attention

__all__ = ["PagedCache", "PagedKV", "gather_slots", "paged_attention", "read_slots"]


class PagedKV(NamedTuple):
    """What `PagedCache.update` returns for one layer: the pool's `key_cache` and `value_cache`
    `(num_blocks, block_size, H_kv, D)`, `block_tables (B, max_blocks) int64` (entries past a
    sequence's last block are 0), `seq_lens (B,) int64`, the tokens each sequence holds (this
    step's included), and `positions (B, S) int64`: for each of the S positions the attention
    mask covers, the token index it reads (None: position p reads token p)."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor | None = None


def gather_kv(paged: PagedKV, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Each sequence's keys and values in logical order, `(B, H_kv, S, D)`: S = max(seq_lens), or
    the width of `paged.positions` (entries for positions a sequence does not hold read its first
    slots: mask them). `slots`: `read_slots(paged)`, if the caller has it (a step's layers do)."""
    slots = read_slots(paged) if slots is None else slots
    return tuple(gather_slots(pool, slots).transpose(1, 2) for pool in paged[:2])


def gather_slots(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`pool (num_blocks, block_size, ...)` read at `slots (B, S)` (flattened pool indices) ->
    `(B, S, ...)`: one `index_select`, the values `flat[slots]` takes, 3-5x faster on a CPU."""
    flat = pool.flatten(0, 1)
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *flat.shape[1:])


def read_slots(paged) -> torch.Tensor:
    """(B, S) int64: the pool slot (`block * block_size + offset`, flattened over the pool) each of
    the S positions of each sequence reads, through its block table: S = max(seq_lens), or the
    width of `paged.positions`."""
    block_size = paged.key_cache.shape[1]
    positions = paged.positions
    if positions is None:
        length = int(paged.seq_lens.max())
        positions = torch.arange(length, device=paged.block_tables.device).expand(
            paged.block_tables.shape[0], length
        )
    blocks = paged.block_tables.gather(1, positions // block_size)  # (B, S): physical blocks
    return blocks * block_size + positions % block_size


def paged_attention(q, kv: PagedKV, mask, *, weights_out=None, scale=None) -> torch.Tensor:
    """Attention over a paged cache, the torch reference: gather each sequence's K/V through its
    block table (`gather_kv`), then `kvlib.ops.attention.reference_attention`, so it computes the
    very numbers a dense cache's reference attention does.

    Args:
        q: (B, H, T, D). kv: a `PagedKV`. mask: (B, T, S) bool, S = max(seq_lens) or the width
            of `kv.positions`.
    Returns:
        (B, H, T, D) in q's dtype.
    """
    return reference_attention(q, gather_kv(kv), mask, weights_out=weights_out, scale=scale)


class PagedCache:
    """A paged KV cache implementing `kvlib.cache.KVCache` (see the module docstring).

    Args:
        num_layers, num_kv_heads, head_dim: the model's L, H_kv, D.
        num_blocks: the pool's size, shared by all layers (each layer has its own storage).
        block_size: token slots per block (vLLM's default is 16).
        dtype, device: of the storage.

    Raises (from `update`): `kvlib.errors.OutOfBlocksError` when the pool cannot hold the step
    (the sequences keep what they had); `ValueError`/`TypeError` for a wrong layer, shape, dtype
    or device, or a batch size other than the cache's.
    """

    attention_backend = staticmethod(paged_attention)
    rollback_refusal: str | None = None  # why `truncate` cannot roll this cache back, if so

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.block_size = check_positive_int("block_size", block_size)
        self.manager = BlockManager(BlockPool(num_blocks, block_size, enable_prefix_caching=False))
        self.dtype = dtype  # of the keys and values the model writes
        self._make_pools(num_blocks, torch.device(device))
        self.length = 0  # positions of the batch, padding included (what the mask covers)
        self.batch_size: int | None = None  # set by the first update
        self._mask: torch.Tensor | None = None  # (B, length + T) bool: this step's real tokens
        self._step: tuple | None = None  # this step's write rows, slots and handle

    @classmethod
    def for_model(
        cls, model, num_sequences: int, max_seq_len: int, *, block_size: int = 16, **options
    ) -> PagedCache:
        """A cache for `model` with room for `num_sequences` sequences of `max_seq_len` tokens
        each, plus one block per sequence for copy-on-write, in the model's dtype and device
        (`options`: a subclass's extra constructor arguments)."""
        c, weight = model.config, model.lm_head.weight
        if c.is_mla:
            raise ValueError(
                "model: a paged cache holds K/V heads; an MLA model caches latent rows "
                "(kvlib.cache.LatentCache)"
            )
        blocks_per_seq = math.ceil(max_seq_len / block_size) + 1
        return cls(
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            num_blocks=num_sequences * blocks_per_seq,
            block_size=block_size,
            dtype=weight.dtype,
            device=weight.device,
            **options,
        )

    @classmethod
    def factory(cls, *, block_size: int = 16, copies_per_sequence: int = 1, **options):
        """`generate`'s `cache=` argument: factory(model, batch_size, max_seq_len) -> a cache from
        `for_model` with room for `copies_per_sequence` copies of each sequence (beams or samples
        that diverge; `options`: a subclass's extra constructor arguments)."""
        copies = check_positive_int("copies_per_sequence", copies_per_sequence)
        return lambda model, batch_size, max_seq_len: cls.for_model(
            model, batch_size * copies, max_seq_len, block_size=block_size, **options
        )

    @property
    def seq_lens(self) -> torch.Tensor:
        """(B,) int64: real tokens held per sequence (padding is not stored)."""
        manager = self.manager
        return torch.tensor(
            [
                manager.num_tokens(b) if b in manager.block_tables else 0
                for b in range(self.batch_size or 0)
            ],
            dtype=torch.int64,
        )

    def begin_forward(self, num_tokens: int, attention_mask: torch.Tensor | None) -> None:
        """Called by the model before its first layer: `attention_mask` (B, length + T), 1 for
        real tokens, or None (no padding). Only real tokens will get slots."""
        self._mask = None if attention_mask is None else attention_mask.bool()

    def _begin_step(self, batch_size: int, num_tokens: int) -> None:
        """Layer 0's update: give this step's real tokens slots (a new sequence's first real
        tokens allocate it), apply the block copies copy-on-write asked for, and build the step's
        block tables and read positions."""
        manager, device = self.manager, self.key_cache[0].device
        if self.batch_size is None:
            self.batch_size = batch_size
        elif batch_size != self.batch_size:
            raise ValueError(
                f"k: expected batch size {self.batch_size} (the cache's sequences), got "
                f"{batch_size}"
            )
        end = self.length + num_tokens
        mask = self._mask
        if mask is None or mask.shape != (batch_size, end):
            mask = torch.ones(batch_size, end, dtype=torch.bool)
        new = mask[:, self.length :].cpu()  # (B, T): which new positions are real tokens
        rows, slots = [], []
        for b in range(batch_size):
            real = new[b].nonzero()[:, 0].tolist()
            if not real:
                continue
            if b not in manager.block_tables:
                manager.allocate(b, [0] * len(real))
                written = [manager.slot(b, i) for i in range(len(real))]
            else:
                written = [manager.append_slot(b, 0) for _ in real]
            rows += [b * num_tokens + t for t in real]
            slots += written
        self._apply_copies()  # copy-on-write, in every layer, before anyone writes
        tables = [manager.block_tables.get(b, []) for b in range(batch_size)]
        width = max(1, max(len(t) for t in tables))
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0).to(device)  # token index read
        handle = PagedKV(None, None, block_tables, self.seq_lens.to(device), positions)
        self._step = (
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(slots, dtype=torch.long, device=device),
            handle,
        )

    def _apply_copies(self) -> None:
        """Copy every block pair copy-on-write asked for (`BlockManager.copies`), in every pool."""
        for src, dst in self.manager.copies:
            for pool in self._pools():
                pool[dst] = pool[src]
        self.manager.copies.clear()

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> PagedKV:
        """Write layer `layer_idx`'s new keys and values `(B, H_kv, T, D)` through the slot
        mapping; return the layer's `PagedKV` for `paged_attention`."""
        check_kv_update(
            self.num_layers,
            layer_idx,
            k,
            v,
            (k.shape[0], self.num_kv_heads, self.head_dim),
            self.dtype,
            self.key_cache[0].device,
        )
        if v.shape[-1] != self.head_dim:
            raise ValueError(f"v: expected head dimension {self.head_dim}, got {v.shape[-1]}")
        if layer_idx == 0:
            self._begin_step(k.shape[0], k.shape[2])
        elif self._step is None:
            raise ValueError(
                f"layer_idx: a step starts at layer 0 (which allocates its slots), got {layer_idx}"
            )
        rows, slots, handle = self._step
        new_k = k.transpose(1, 2).flatten(0, 1)[rows]  # (real tokens, H_kv, D)
        new_v = v.transpose(1, 2).flatten(0, 1)[rows]
        return self._write(layer_idx, slots, new_k, new_v, handle)

    def write_slots(self, layer_idx, slots, new_k, new_v, handle):
        """Store keys and values `(N, H_kv, D)` at pool `slots` `(N,)` (int64 slot indices
        `block * block_size + offset`) in layer `layer_idx`, in this cache's layout; return the
        layer's handle for `attention_backend`. For a caller that chooses the slots itself (the
        serving engine's flattened batch, `kvlib.engine.batch`); `update` chooses them here."""
        return self._write(layer_idx, slots, new_k, new_v, handle)

    def block_tensors(self) -> list[torch.Tensor]:
        """Every per-block tensor of every layer (`(num_blocks, block_size, ...)`, codes and
        scales too in a quantized layout): what a block copy copies, what a block's bytes
        count."""
        return self._pools()

    def reallocate(self, num_blocks: int, device) -> None:
        """Replace the pools by zeroed ones of `num_blocks` blocks on `device` (the engine adds
        a scratch block past the last for CUDA graphs' padding rows). Raises ValueError for
        `num_blocks` < 1."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected an int >= 1, got {num_blocks!r}")
        self._make_pools(num_blocks, torch.device(device))

    def _write(self, layer_idx, slots, new_k, new_v, handle):
        """Store the step's real tokens' keys and values `(N, H_kv, D)` at pool `slots` `(N,)`;
        return the layer's handle for `attention_backend` (a subclass stores another layout)."""
        self.key_cache[layer_idx].view(-1, self.num_kv_heads, self.head_dim)[slots] = new_k
        self.value_cache[layer_idx].view(-1, self.num_kv_heads, self.head_dim)[slots] = new_v
        return handle._replace(
            key_cache=self.key_cache[layer_idx], value_cache=self.value_cache[layer_idx]
        )

    def _make_pools(self, num_blocks: int, device: torch.device) -> None:
        """Allocate every layer's `key_cache` and `value_cache` `(num_blocks, block_size, H_kv,
        D)` (a subclass storing another layout allocates its own)."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.key_cache = [
            torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)
        ]
        self.value_cache = [
            torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)
        ]

    def _pools(self) -> list[torch.Tensor]:
        """Every per-block tensor of every layer (`(num_blocks, block_size, ...)`): what a block
        copy copies and what a block's bytes count."""
        return self.key_cache + self.value_cache

    def advance(self, num_tokens: int) -> None:
        """Commit `num_tokens` new tokens (after every layer has written them)."""
        self.length += check_positive_int("num_tokens", num_tokens)
        self._step = self._mask = None

    def truncate(self, length: int) -> None:
        """Roll the batch back to its first `length` positions (speculative decoding's rollback of
        rejected draft tokens, chapter 16): each sequence drops the tokens it holds past them
        (`BlockManager.truncate`: blocks left empty return to the pool, a shared partial block is
        copied on write, a private one leaves the prefix cache), the dropped slots of a kept
        block are zeroed in every layer, and a sequence left with no token is freed. The cache
        then reads as one that never saw the later positions. A rollback to 0 leaves it empty, as
        new.

        Raises:
            ValueError: `length` not an int in [0, self.length].
            OutOfBlocksError: a shared partial block needs a copy and no block is free (the cache
                is left as it was).
            NotImplementedError: a cache that cannot roll back (`rollback_refusal` says why).
        """
        if self.rollback_refusal:
            raise NotImplementedError(
                f"{type(self).__name__} does not roll back: {self.rollback_refusal}"
            )
        length = check_truncate_length(length, self.length)
        dropped = self.length - length  # every sequence's newest positions, padding trailing none
        manager, bs = self.manager, self.block_size
        kept = {b: manager.num_tokens(b) - dropped for b in sorted(manager.block_tables)}
        copies = any(  # a kept partial block that is shared: copy-on-write, which may fail
            n > 0 and n % bs and manager.pool.blocks[manager.block_tables[b][n // bs]].ref_cnt > 1
            for b, n in kept.items()
        )
        saved = copy.deepcopy(manager) if copies else None  # the allocator, restored on failure
        try:
            for b in kept:
                if kept[b] > 0:
                    manager.truncate(b, kept[b])
                else:
                    manager.free(b)
        except OutOfBlocksError:
            self.manager = saved  # no K/V was touched yet
            raise
        self._apply_copies()  # before zeroing: a copy takes the shared block's slots as they are
        for b, keep in kept.items():
            if keep > 0 and keep % bs:
                self._truncated_block(manager.block_tables[b][-1], keep % bs)
        self.length = length
        self.batch_size = self.batch_size if manager.block_tables else None
        self._step = self._mask = None

    def move_tokens(self, src, dst) -> None:
        """Copy the K/V of positions `src` to positions `dst` of every sequence (as
        `DynamicCache.move_tokens`; positions of the batch, each sequence holding all of them),
        through each sequence's slots, in every per-slot pool.

        Raises:
            ValueError: as `kvlib.cache.base.check_moves`; a sequence with padding; a destination
                in a block another sequence also holds (its K/V would change).
            NotImplementedError: a cache that cannot roll back (`rollback_refusal`).
        """
        if self.rollback_refusal:
            raise NotImplementedError(
                f"{type(self).__name__} does not move tokens back: {self.rollback_refusal}"
            )
        src, dst = check_moves(src, dst, self.length)
        manager, moves = self.manager, []
        for b in sorted(manager.block_tables):  # every sequence checked before any moves
            if manager.num_tokens(b) != self.length:
                raise ValueError(f"move_tokens: sequence {b} has padding; expected none")
            for p in dst:
                block = manager.block_tables[b][p // self.block_size]
                if manager.pool.blocks[block].ref_cnt > 1:
                    raise ValueError(f"dst: position {p} of sequence {b} is in a shared block")
            moves.append(([manager.slot(b, p) for p in src], [manager.slot(b, p) for p in dst]))
        for src_slots, dst_slots in moves:
            self._move_slots(src_slots, dst_slots)

    def _move_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        for pool in self._pools():
            flat = pool.flatten(0, 1)
            flat[dst_slots] = flat[src_slots]

    def _truncated_block(self, block: int, kept_slots: int) -> None:
        """The slots past `kept_slots` of a block a rollback kept, zeroed in every per-slot pool
        (as never written). A subclass with per-block state recomputes it here."""
        for pool in self._pools():
            pool[block, kept_slots:] = 0

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` (B',) in that order (beam search): each kept beam is forked
        (its blocks shared, nothing copied) and the old sequences freed."""
        order = [int(i) for i in indices.tolist()]
        manager = self.manager
        for new, old in enumerate(order):
            manager.fork(old, ("next", new))
        for old in range(self.batch_size):
            manager.free(old)
        for new in range(len(order)):
            self._rename(("next", new), new)
        self.batch_size = len(order)

    def _rename(self, old, new) -> None:
        manager = self.manager
        for table in (manager.block_tables, manager.token_ids, manager.block_hashes):
            table[new] = table.pop(old)
        if old in manager.unhashed:
            manager.unhashed.discard(old)
            manager.unhashed.add(new)

    def repeat(self, num_copies: int) -> PagedCache:
        """The cache with each sequence copied `num_copies` times, consecutively (prefill once,
        decode several samples or beams): the copies share the blocks (reference counts), nothing
        is copied until a copy appends into a shared block. The sequences move to the returned
        cache; this one is left holding none."""
        num_copies = check_positive_int("num_copies", num_copies)
        order = torch.arange(self.batch_size or 0).repeat_interleave(num_copies)
        bigger = copy.copy(self)
        bigger.reorder(order)
        self.manager = BlockManager(
            BlockPool(self.manager.pool.num_blocks, self.block_size, enable_prefix_caching=False)
        )
        self.batch_size, self.length = None, 0
        self.key_cache, self.value_cache = [], []
        return bigger

    @property
    def num_blocks_in_use(self) -> int:
        pool = self.manager.pool
        return pool.num_blocks - pool.num_free_blocks

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks in use (K and V, every layer): the memory the sequences hold."""
        per_block = sum(c[0].numel() * c.element_size() for c in self._pools())
        return self.num_blocks_in_use * per_block
