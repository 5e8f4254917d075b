"""Chapter 9's compaction plans, as pure functions of which slots are live: the blocks freed at no
copy (`freeable_blocks`), the moves of an order-preserving repack (`plan_repack`) and of
hole-filling (`plan_hole_filling`); `SlotMap`, a sequence's slot -> position-in-text map, and
`CompactionReport`, what a pass did. `kvlib.cache.compaction` applies them to a paged cache.

Slot indices here are a sequence's own: slot `i` is `block_table[i // block_size] * block_size +
i % block_size` in the pool (the slot mapping).

- **repack** (`plan_repack`): the survivors
  slide forward, keeping their order, into the first slots. Order is preserved, so slot index and
  token order still agree, but every survivor behind the first hole is copied.
- **hole-filling** (`plan_hole_filling`): the survivors at the back (the newest) drop into the
  holes at the front, two fingers meeting in the middle (the classic two-finger compactor), so a
  pass copies at most one token per hole; older survivors never move. The same blocks are freed
  (survivors end up in the first slots either way), but physical order no longer follows the text:
  each slot's **position in the text** is kept in a map (`SlotMap.positions`) and everything that
  reads positions (RoPE, the causal mask, the policies' "most recent") reads the map.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from kvlib._validate import check_positive_int

STRATEGIES = ("repack", "hole_filling")


def _check_live(live: Sequence[bool], start: int) -> list[bool]:
    flags = [bool(x) for x in live]
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(flags):
        raise ValueError(f"start: expected an int in [0, {len(flags)}], got {start!r}")
    return flags


def freeable_blocks(live: Sequence[bool], block_size: int) -> list[int]:
    """The blocks a sequence can give back without moving anything: those whose slots all hold
    evicted tokens. `live[i]` says whether slot i holds a survivor; returns block indices (into the
    sequence's block table), ascending. A partly filled last block counts only its filled slots.
    """
    block_size = check_positive_int("block_size", block_size)
    flags = _check_live(live, 0)
    return [
        i
        for i in range(math.ceil(len(flags) / block_size))
        if not any(flags[i * block_size : (i + 1) * block_size])
    ]


def plan_repack(live: Sequence[bool], start: int = 0) -> list[tuple[int, int]]:
    """Order-preserving repack of slots `start` onward: the k-th survivor moves to slot
    `start + k`. Returns the (src, dst) slot moves in slot order, survivors already in place left
    out. Every move goes down (dst < src), so a destination can only be an *earlier* move's
    source: copied one at a time in the order given, each slot is read before it is overwritten;
    in reverse order, or by concurrent copies (a GPU kernel's threads), a move can read a slot an
    earlier move has already overwritten. Reading every src before writing any dst (what
    `CompactingPagedCache.compact` does) is safe in any order. After it the survivors fill slots
    [start, start + survivors)."""
    flags = _check_live(live, start)
    moves, dst = [], start
    for src in range(start, len(flags)):
        if flags[src]:
            if src != dst:
                moves.append((src, dst))
            dst += 1
    return moves


def plan_hole_filling(live: Sequence[bool], start: int = 0) -> list[tuple[int, int]]:
    """Hole-filling of slots `start` onward, two fingers: the last survivor moves into the first
    hole, the one before it into the next hole, until the holes are all behind the survivors.
    Returns the (src, dst) moves (sources and destinations are disjoint: holes are dead). Older
    survivors never move and a pass copies at most one token per hole, but the moved tokens are
    out of text order: keep each slot's position."""
    flags = _check_live(live, start)
    holes = [i for i in range(start, len(flags)) if not flags[i]]
    survivors = [i for i in range(start, len(flags)) if flags[i]]
    moves = []
    for hole, src in zip(holes, reversed(survivors)):
        if hole > src:
            break
        moves.append((src, hole))
    return moves


@dataclasses.dataclass
class SlotMap:
    """One sequence's slots, in slot order (slot i of the sequence, see the module docstring):
    `positions (n,) int64`, each slot's token position in the text, -1 for an evicted token;
    `scores (n,) float32` and `seen (n,) int64`, the policy's accumulated attention and the number
    of queries that saw the token (H2O)."""

    positions: torch.Tensor
    scores: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def empty(cls) -> SlotMap:
        return cls(
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.float32),
            torch.zeros(0, dtype=torch.int64),
        )

    @property
    def live(self) -> torch.Tensor:
        """(n,) bool: slots holding a survivor."""
        return self.positions >= 0

    def append(self, positions: torch.Tensor) -> None:
        """New tokens at text positions `positions` take the next slots."""
        self.positions = torch.cat([self.positions, positions])
        self.scores = torch.cat([self.scores, torch.zeros(len(positions))])
        self.seen = torch.cat([self.seen, torch.zeros(len(positions), dtype=torch.int64)])

    def take(self, index: torch.Tensor) -> SlotMap:
        """The slots `index` (n',) in that order."""
        return SlotMap(self.positions[index], self.scores[index], self.seen[index])

    def move(self, moves: Sequence[tuple[int, int]], num_slots: int) -> SlotMap:
        """The map after a pass: slot dst takes slot src's entry for every (src, dst), then the
        first `num_slots` slots are kept."""
        index = torch.arange(len(self.positions))
        if moves:
            src, dst = torch.tensor(moves).T
            index[dst] = src
        return self.take(index[:num_slots])

    def clone(self) -> SlotMap:
        return SlotMap(self.positions.clone(), self.scores.clone(), self.seen.clone())


@dataclasses.dataclass
class CompactionReport:
    """What one pass (or a release of empty blocks) did, summed over the batch.

    strategy: "repack", "hole_filling", or "release" (`release_empty_blocks`: no copies);
    blocks_freed: blocks the sequences gave back (free in the pool unless another sequence holds
    them); slots_copied: token slots moved (each one is K and V of every layer); blocks_pinned:
    blocks skipped because another sequence holds them; tokens_held/slots_held: survivors and slots
    in use after the pass (slots_held - tokens_held are dead slots still held); seconds: the
    pass's wall time, K/V copies and bookkeeping (0 for a release)."""

    strategy: str
    blocks_freed: int = 0
    slots_copied: int = 0
    blocks_pinned: int = 0
    tokens_held: int = 0
    slots_held: int = 0
    seconds: float = 0.0
