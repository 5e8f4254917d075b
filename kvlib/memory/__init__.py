"""How many bytes a model's KV cache holds, and how many sequences fit on a GPU (chapter 3).

One concept per module, in the order they depend on each other:

- `layers`: what each layer of a model caches per sequence (`layer_specs`), read from its
  `config.json` through `kvlib.config`;
- `equation`: the cache-size equation over those layers (`kv_cache_bytes`, `cache_report`);
- `budget`: the whole-VRAM budget and the sequences that fit (`memory_budget`);
- `sparse`: the per-page key bounds of query-aware sparse attention, stored and read per decode
  step (`page_bounds_bytes`, `sparse_decode_read_bytes`; chapter 15);
- `cli`: `python -m kvlib.memory CONFIG.json --seq-len N`.

Everything public is re-exported here, so `kvlib.memory.kv_cache_bytes` is the name to use.
"""

from kvlib.config import DTYPE_BITS, config_dtype, load_config, normalize_dtype, shipped_configs
from kvlib.memory.budget import (
    MemoryBudget,
    max_concurrent_sequences,
    memory_budget,
    prefill_activation_bytes,
)
from kvlib.memory.equation import (
    DEFAULT_DTYPE,
    CacheReport,
    LayerUsage,
    cache_report,
    format_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    quantized_kv_cache_bytes,
)
from kvlib.memory.layers import (
    DENSE_ATTENTION,
    HYBRID,
    MLA,
    SIZED_MODEL_TYPES,
    SSM,
    LayerSpec,
    layer_specs,
)
from kvlib.memory.sparse import page_bounds_bytes, sparse_decode_read_bytes

__all__ = [
    "DEFAULT_DTYPE",
    "DENSE_ATTENTION",
    "DTYPE_BITS",
    "HYBRID",
    "MLA",
    "SSM",
    "SIZED_MODEL_TYPES",
    "CacheReport",
    "LayerSpec",
    "LayerUsage",
    "MemoryBudget",
    "cache_report",
    "config_dtype",
    "format_bytes",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "layer_specs",
    "load_config",
    "max_concurrent_sequences",
    "memory_budget",
    "normalize_dtype",
    "page_bounds_bytes",
    "prefill_activation_bytes",
    "quantized_kv_cache_bytes",
    "shipped_configs",
    "sparse_decode_read_bytes",
]
