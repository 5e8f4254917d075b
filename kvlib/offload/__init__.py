"""The KV cache beyond one device (chapter 14): tiers below the device's block pool, and KV
transfer between engines.

- `keys`: the salted block key: chapter 7's chained block hash, salted with what makes two
  engines' K/V for the same tokens differ (model, dtype, quantization scheme, RoPE, block size);
- `store`: `TieredStore`, a stack of tiers (host memory, then disk), each with a capacity, LRU
  eviction, byte accounting and a modelled bandwidth; `MemoryTier`;
- `disk`: `DiskTier`, blocks as safetensors files written to a temporary name, then renamed;
- `engine`: `OffloadEngine`, chapter 12's engine whose prefix lookup walks device → host → disk,
  demoting the blocks its pool evicts and promoting hits;
- `transfer`: shipping a request's blocks from a prefill engine to a decode engine over ZeroMQ.
"""

from kvlib.offload.disk import DiskTier
from kvlib.offload.keys import block_key, engine_salt, kv_salt, salted_block_keys
from kvlib.offload.store import MemoryTier, TieredStore, payload_nbytes

__all__ = [
    "DiskTier",
    "MemoryTier",
    "TieredStore",
    "block_key",
    "engine_salt",
    "kv_salt",
    "payload_nbytes",
    "salted_block_keys",
]
