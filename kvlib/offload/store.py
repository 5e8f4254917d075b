"""A tiered block store (chapter 14): the tiers below the device's block pool.

A block leaving the device pool (evicted by an allocation) is **demoted** into the store's first
tier (host memory); a tier over its capacity demotes its least recently used blocks to the next
tier (disk), and the last tier drops them. A prefix lookup that misses on the device walks the
tiers; a hit is **promoted**: the block moves up to the first tier (and the engine copies it into
its pool), charged `nbytes / bandwidth` of the tier it came from (a modelled bandwidth, stated by
the caller: the notebook uses PCIe for host memory and an NVMe SSD for disk).

A payload is one block's tensors: a dict name -> CPU tensor (K and V of every layer, and the scales
of a quantized cache). The store never looks inside: it counts bytes (`payload_nbytes`) and
returns what it was given.

Invariants (`check_invariants`, which the hypothesis state machine in tests/test_offload.py calls
after every operation): a key lives in at most one tier; each tier's `used_bytes` is exactly the sum
of its blocks' bytes and at most its capacity. What a hit returns is what was put.

Deliberately not here: concurrency (one process uses a store at a time), write-back batching,
layer-wise pipelining of transfers (LMCache and SGLang's HiCache overlap them with compute).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

__all__ = ["MemoryTier", "StoreStats", "TierIndex", "TieredStore", "payload_nbytes"]


def payload_nbytes(payload: dict[str, torch.Tensor]) -> int:
    """Bytes of a block's tensors (their elements only)."""
    return sum(t.numel() * t.element_size() for t in payload.values())


class TierIndex:
    """What every tier keeps the same way: `sizes`, each block's payload bytes by key, least
    recently used first, and `used_bytes`, their sum."""

    sizes: dict[bytes, int]
    used_bytes: int

    def __init__(self, name: str, capacity_bytes: int, bandwidth_bytes_per_s: float):
        """Raises ValueError for a negative capacity or a bandwidth that is not positive."""
        if capacity_bytes < 0 or bandwidth_bytes_per_s <= 0:
            raise ValueError(
                f"capacity_bytes, bandwidth_bytes_per_s: expected >= 0 and > 0, got "
                f"{capacity_bytes}, {bandwidth_bytes_per_s}"
            )
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self.bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)

    def __contains__(self, key: bytes) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def keys(self) -> list[bytes]:
        """Keys, least recently used first."""
        return list(self.sizes)


class MemoryTier(TierIndex):
    """Blocks in host memory: an LRU-ordered dict key -> payload (least recently used first).

    Args:
        name: shown in statistics ("host").
        capacity_bytes: the tier holds at most this many payload bytes.
        bandwidth_bytes_per_s: the modelled speed of copying a block from here to the device.
    """

    durable = False  # a crash loses it

    def __init__(self, name: str, capacity_bytes: int, bandwidth_bytes_per_s: float):
        super().__init__(name, capacity_bytes, bandwidth_bytes_per_s)
        self.blocks: OrderedDict[bytes, dict[str, torch.Tensor]] = OrderedDict()
        self.sizes: dict[bytes, int] = {}
        self.used_bytes = 0

    def put(self, key: bytes, payload: dict[str, torch.Tensor]) -> None:
        """Add a block as most recently used (the caller makes room first)."""
        self.blocks[key] = {name: t.detach().cpu().clone() for name, t in payload.items()}
        self._account(key, payload_nbytes(payload))

    def _account(self, key: bytes, nbytes: int) -> None:
        self.sizes[key] = nbytes
        self.used_bytes += nbytes

    def get(self, key: bytes) -> dict[str, torch.Tensor]:
        """The block's payload (KeyError if absent); it becomes most recently used."""
        self.touch(key)
        return self.blocks[key]

    def touch(self, key: bytes) -> None:
        self.sizes[key] = self.sizes.pop(key)
        self.blocks.move_to_end(key)

    def pop(self, key: bytes) -> dict[str, torch.Tensor]:
        payload = self.blocks.pop(key)
        self.used_bytes -= self.sizes.pop(key)
        return payload

    def lru_key(self) -> bytes:
        return next(iter(self.sizes))

    def clear(self) -> None:
        """What a crash does to memory."""
        self.blocks.clear()
        self.sizes.clear()
        self.used_bytes = 0


@dataclasses.dataclass
class StoreStats:
    """Counts since the store was made: lookups that hit in each tier and that missed, blocks put,
    demoted from each tier to the next, dropped off the last tier, and bytes promoted from each
    tier with their modelled transfer seconds."""

    hits: dict[str, int] = dataclasses.field(default_factory=dict)
    misses: int = 0
    puts: int = 0
    demoted: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped: int = 0
    promoted_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    transfer_s: float = 0.0


class TieredStore:
    """Tiers, fastest first (a `MemoryTier` for host memory, then a `kvlib.offload.DiskTier`),
    keyed by salted block keys (`kvlib.offload.keys`). See the module docstring.

    Raises (from the methods): `TypeError` for a key that is not bytes or a payload that is not a
    dict of tensors.
    """

    def __init__(self, tiers):
        if not tiers:
            raise ValueError("tiers: expected at least one tier")
        self.tiers = list(tiers)
        self.stats = StoreStats()

    def tier_of(self, key: bytes) -> int | None:
        """Index of the tier holding `key`, or None: no side effects (no LRU update, no stats)."""
        for i, tier in enumerate(self.tiers):
            if key in tier:
                return i
        return None

    def __contains__(self, key: bytes) -> bool:
        return self.tier_of(key) is not None

    def put(self, key: bytes, payload: dict[str, torch.Tensor]) -> None:
        """Demote a block from the device into the first tier (most recently used there). A key
        already stored is only refreshed (its bytes are the same: equal keys, equal K/V). Older
        blocks cascade down to make room; a block larger than a tier passes it by."""
        if not isinstance(key, bytes):
            raise TypeError(f"key: expected bytes, got {type(key).__name__}")
        if not isinstance(payload, dict) or not all(
            isinstance(t, torch.Tensor) for t in payload.values()
        ):
            raise TypeError("payload: expected a dict of name -> torch.Tensor")
        self.stats.puts += 1
        where = self.tier_of(key)
        if where is not None:
            payload = self.tiers[where].get(key)
            if where == 0:
                return
            self.tiers[where].pop(key)
        self._insert(0, key, payload)

    def _insert(self, index: int, key: bytes, payload: dict[str, torch.Tensor]) -> None:
        """Put a block into tier `index`, first moving that tier's LRU blocks down until it fits."""
        if index == len(self.tiers):
            self.stats.dropped += 1
            return
        tier, nbytes = self.tiers[index], payload_nbytes(payload)
        if nbytes > tier.capacity_bytes:
            self._insert(index + 1, key, payload)
            return
        while tier.used_bytes + nbytes > tier.capacity_bytes:
            old = tier.lru_key()
            self.stats.demoted[tier.name] = self.stats.demoted.get(tier.name, 0) + 1
            self._insert(index + 1, old, tier.pop(old))
        tier.put(key, payload)

    def get(
        self, key: bytes, *, promote: bool = True
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Look `key` up, fastest tier first. A hit returns (the tier it was found in, its
        payload), charges the modelled transfer (`stats.transfer_s`), and, with `promote`, moves
        the block up to the first tier; a miss returns None."""
        where = self.tier_of(key)
        if where is None:
            self.stats.misses += 1
            return None
        tier = self.tiers[where]
        payload = tier.get(key)
        nbytes = payload_nbytes(payload)
        self.stats.hits[tier.name] = self.stats.hits.get(tier.name, 0) + 1
        self.stats.promoted_bytes[tier.name] = self.stats.promoted_bytes.get(tier.name, 0) + nbytes
        self.stats.transfer_s += nbytes / tier.bandwidth_bytes_per_s
        if promote and where > 0:
            tier.pop(key)
            self._insert(0, key, payload)
        return where, payload

    def evict(self, key: bytes) -> bool:
        """Drop a block from whichever tier holds it; whether it was there."""
        where = self.tier_of(key)
        if where is not None:
            self.tiers[where].pop(key)
        return where is not None

    def crash(self) -> None:
        """What a process crash leaves: memory tiers empty, durable tiers reread from disk (a
        block whose write had not finished is not there)."""
        for tier in self.tiers:
            if tier.durable:
                tier.reopen()
            else:
                tier.clear()

    @property
    def used_bytes(self) -> list[int]:
        return [tier.used_bytes for tier in self.tiers]

    def check_invariants(self) -> None:
        """Raise AssertionError (naming the rule) unless every key is in one tier at most and
        every tier's byte count is exact and within its capacity."""
        seen: dict[bytes, str] = {}
        for tier in self.tiers:
            keys = tier.keys()
            assert len(keys) == len(set(keys)) == len(tier), f"{tier.name}: a key listed twice"
            for key in keys:
                assert key not in seen, f"key {key.hex()[:12]} in {seen.get(key)} and {tier.name}"
                seen[key] = tier.name
            assert tier.used_bytes == sum(tier.sizes.values()), f"{tier.name}: byte count drifted"
            assert tier.used_bytes <= tier.capacity_bytes, (
                f"{tier.name}: {tier.used_bytes} bytes over its capacity {tier.capacity_bytes}"
            )
