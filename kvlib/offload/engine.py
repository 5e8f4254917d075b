"""Chapter 12's engine with tiers below its block pool (chapter 14): `OffloadEngine`.

Three pieces plug into the engine without changing its scheduler or runner:

- `DemotingBlockPool`: chapter 7's `BlockPool` whose allocations, before they overwrite a free
  cached block (an eviction), hand that block to `demote`; the engine copies its K/V (and scales,
  for a quantized cache) into the store under its salted key (`kvlib.offload.keys`).
- `TieredBlockManager`: chapter 7's `BlockManager` whose prefix lookup walks the tiers: the device
  prefix cache first (chapter 7's walk), then, from the first block the device misses, the store.
  Each store hit is **promoted**: a device block is allocated, the payload copied into it, and the
  block registered in the device prefix cache as if it had never left; the scheduler then admits
  the request exactly as for a device hit. Each promotion is charged `nbytes / bandwidth` of the
  tier it came from (`transfer_s`).
- `OffloadEngine`: builds them, and charges the step that promoted its transfer time on the
  engine's clock (`LLMEngine._charged_seconds`), so TTFT includes it.

Equal keys mean equal K/V bytes, so a request served from a promoted block computes what it would
from a device hit; tests/test_offload.py checks the tokens equal those without tiers.

Deliberately not here: asynchronous (overlapped) transfers, write-through of every new block
(LMCache stores blocks as they are computed; here a block reaches the store only when the device
evicts it), and offloading the blocks of running requests (swapping, vLLM v0's preemption mode).
"""

from __future__ import annotations

import itertools

import torch

from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool, hash_block_tokens
from kvlib.engine.llm_engine import LLMEngine
from kvlib.offload.keys import block_key, engine_salt
from kvlib.offload.store import TieredStore, payload_nbytes

__all__ = [
    "DemotingBlockPool",
    "OffloadEngine",
    "TieredBlockManager",
    "block_pools",
    "read_block",
    "write_block",
]

POOL_NAMES = ("key_cache", "value_cache", "key_scale", "value_scale", "key_zero", "value_zero")


def block_pools(storage) -> dict[str, torch.Tensor]:
    """Every per-block pool of a `PagedCache` (or `QuantizedPagedCache`), by name ("key_cache.0":
    layer 0's keys; "key_scale.3": layer 3's key scales), each `(num_blocks, block_size, ...)`."""
    return {
        f"{name}.{layer}": pool
        for name in POOL_NAMES
        for layer, pool in enumerate(getattr(storage, name, None) or [])
    }


def read_block(storage, block_id: int) -> dict[str, torch.Tensor]:
    """One block's payload: a CPU copy of its slice of every pool, `(block_size, H_kv, ...)`."""
    return {name: pool[block_id].cpu().clone() for name, pool in block_pools(storage).items()}


def write_block(storage, block_id: int, payload: dict[str, torch.Tensor]) -> None:
    """Copy a payload into block `block_id` of every pool.

    Raises:
        ValueError: the payload's names or shapes are not the storage's (another layout)."""
    pools = block_pools(storage)
    if set(payload) != set(pools):
        raise ValueError(
            f"payload: expected tensors {sorted(pools)[:4]}..., got {sorted(payload)[:4]}..."
        )
    for name, pool in pools.items():
        if payload[name].shape != pool.shape[1:] or payload[name].dtype != pool.dtype:
            raise ValueError(
                f"payload[{name!r}]: expected {tuple(pool.shape[1:])} {pool.dtype}, got "
                f"{tuple(payload[name].shape)} {payload[name].dtype}"
            )
        pool[block_id].copy_(payload[name])


class DemotingBlockPool(BlockPool):
    """A prefix-caching `BlockPool` that calls `demote(block_id, block_hash)` for each cached block
    an allocation is about to evict, while its K/V is still intact."""

    def __init__(self, num_blocks: int, block_size: int, *, demote):
        super().__init__(num_blocks, block_size, enable_prefix_caching=True)
        self.demote = demote

    def allocate(self, num_blocks: int) -> list[int]:
        if isinstance(num_blocks, int) and 0 <= num_blocks <= len(self.free_queue):
            for block_id in itertools.islice(self.free_queue, num_blocks):  # the ones taken
                block_hash = self.blocks[block_id].block_hash
                if block_hash is not None and self.cached_blocks.get(block_hash) == block_id:
                    self.demote(block_id, block_hash)
        return super().allocate(num_blocks)


class TieredBlockManager(BlockManager):
    """A `BlockManager` whose prefix lookup continues into `store` where the device's prefix cache
    stops, promoting each hit into a device block (see the module docstring).

    Counters: `promoted` (blocks per tier name), `transfer_s` (modelled seconds of promotions)."""

    def __init__(self, pool: DemotingBlockPool, *, store: TieredStore, salt: bytes, storage):
        super().__init__(pool)
        self.store, self.salt, self.storage = store, salt, storage
        self.promoted: dict[str, int] = {}
        self.transfer_s = 0.0

    def _cached_prefix(self, token_ids):
        hits, hashes = super()._cached_prefix(token_ids)  # the device tier
        num_full = (len(token_ids) - 1) // self.block_size  # never the whole prompt
        bs = self.block_size

        def next_hash():
            i = len(hashes)
            return hash_block_tokens(
                hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs]
            )

        if len(hits) == num_full or block_key(self.salt, next_hash()) not in self.store:
            return hits, hashes
        self.pool.touch(hits)  # held while promoting, so that no promotion evicts them
        promoted = []
        while len(hashes) < num_full and self.pool.num_free_blocks > 0:
            block_hash = next_hash()
            found = self.store.get(block_key(self.salt, block_hash))  # moves it up the store
            if found is None:
                break
            where, payload = found
            tier = self.store.tiers[where]
            (block_id,) = self.pool.allocate(1)  # may demote another cached block
            write_block(self.storage, block_id, payload)
            self.pool.cache_full_block(block_id, block_hash)
            self.promoted[tier.name] = self.promoted.get(tier.name, 0) + 1
            self.transfer_s += payload_nbytes(payload) / tier.bandwidth_bytes_per_s
            promoted.append(block_id)
            hashes.append(block_hash)
        self.pool.free(reversed(hits + promoted))  # cached and free again, the head freed last
        return hits + promoted, hashes


class OffloadEngine(LLMEngine):
    """`LLMEngine` with prefix caching whose evicted blocks go to `store` and come back on a
    prefix hit (see the module docstring).

    Args:
        model: as `LLMEngine`'s.
        store: a `kvlib.offload.TieredStore` (several engines of one model may share it: keys are
            salted with the model, dtype, quantization scheme, RoPE and block size).
        **config: `EngineConfig`'s fields; prefix caching is on.
    """

    def __init__(self, model, *, store: TieredStore, **config):
        if not config.setdefault("enable_prefix_caching", True):
            raise ValueError("enable_prefix_caching: the tiers extend the prefix cache; keep it on")
        if not isinstance(store, TieredStore):
            raise TypeError(f"store: expected a TieredStore, got {type(store).__name__}")
        super().__init__(model, **config)
        self.store = store
        self.salt = engine_salt(
            model, kv_scheme=self.config.kv_scheme, block_size=self.config.block_size
        )
        self.num_demoted = 0
        pool = DemotingBlockPool(
            self.config.num_blocks, self.config.block_size, demote=self._demote
        )
        manager = TieredBlockManager(pool, store=store, salt=self.salt, storage=self.storage)
        # the engine's parts share one manager: swap it in everywhere chapter 12 put its own
        self.storage.manager = self.manager = self.scheduler.manager = manager
        self.runner.manager = manager
        self._charged_s = 0.0

    def _demote(self, block_id: int, block_hash: bytes) -> None:
        self.store.put(block_key(self.salt, block_hash), read_block(self.storage, block_id))
        self.num_demoted += 1

    def _charged_seconds(self) -> float:
        """The promotions' modelled transfer time since the last step."""
        charged, self._charged_s = (
            self.manager.transfer_s - self._charged_s,
            self.manager.transfer_s,
        )
        return charged
