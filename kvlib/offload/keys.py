"""Salted block keys (chapter 14): what names a block of K/V outside one engine.

Inside one engine, chapter 7's chained hash (`kvlib.cache.block_pool.hash_block_tokens`) is
enough: every block of the pool was computed by the same model, in the same dtype and layout. A
store shared by several engines, or kept on disk across restarts, is not: the same tokens give
different K/V under another model's weights, another dtype, another quantization scheme, another
RoPE (theta, scaling) or another block size. LMCache's cache key carries the model name, the
KV dtype and the chunk's hash for that reason; vLLM salts its prefix-cache hashes per request
(`cache_salt`) to keep tenants apart.

`block_key(salt, block_hash)` is SHA-256 of the salt followed by the chained block hash. The chain
already covers the whole prefix (so the block's position: a rotated key is only valid at the
offset it was computed at), and the salt covers the rest. What it deliberately does not cover:
a block that another process wrote under a salt it lied about, or a block that is not
full (a partial block is never keyed: its content still changes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch

from kvlib.cache.block_pool import hash_block_tokens

__all__ = ["block_key", "engine_salt", "kv_salt", "salted_block_keys", "weights_fingerprint"]


def kv_salt(
    *,
    model_id: str,
    dtype: str,
    kv_scheme: str | None,
    rope: str,
    block_size: int,
) -> bytes:
    """32 bytes naming everything that makes K/V for the same tokens differ: the model (an id
    string: a name and a fingerprint of its weights), the K/V dtype, the quantization scheme (None:
    none), the RoPE variant and the block size. Equal salts mean interchangeable blocks."""
    fields = dict(
        model_id=model_id, dtype=dtype, kv_scheme=kv_scheme, rope=rope, block_size=block_size
    )
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()


def weights_fingerprint(model) -> str:
    """SHA-256 (hex) over every parameter's name and bytes, in order: two checkpoints of one
    architecture (a fine-tune, an uptrained variant) get different fingerprints."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def engine_salt(model, *, kv_scheme=None, block_size: int = 16) -> bytes:
    """The salt of an engine serving `model` (a `kvlib.model.LlamaModel`) with K/V stored as
    `kv_scheme` (a `kvlib.quant.QuantScheme` or None): the model's type and size and its weights'
    fingerprint, its dtype, the scheme, the RoPE fields and the block size."""
    c = model.config
    dtype = model.lm_head.weight.dtype
    rope = json.dumps(dict(theta=c.rope_theta, scaling=c.rope_scaling), sort_keys=True)
    shape = f"{c.model_type}/{c.num_hidden_layers}x{c.hidden_size}"
    return kv_salt(
        model_id=f"{shape}/{weights_fingerprint(model)}",
        dtype=str(dtype).removeprefix("torch."),
        kv_scheme=None if kv_scheme is None else repr(kv_scheme),
        rope=rope,
        block_size=block_size,
    )


def block_key(salt: bytes, block_hash: bytes) -> bytes:
    """The store's key of a full block: SHA-256(salt || chained block hash), 32 bytes."""
    if not isinstance(salt, bytes) or not isinstance(block_hash, bytes):
        raise TypeError(
            f"salt, block_hash: expected bytes, got {type(salt).__name__}, "
            f"{type(block_hash).__name__}"
        )
    return hashlib.sha256(salt + block_hash).digest()


def salted_block_keys(salt: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The keys of the full blocks of `token_ids` (a partial last block gets none), in order."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(
            parent, [int(t) for t in token_ids[i * block_size : (i + 1) * block_size]]
        )
        keys.append(block_key(salt, parent))
    return keys
