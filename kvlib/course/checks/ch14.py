"""Chapter 14's graded questions: the salted block keys of a prompt, promotion and demotion with LRU
in a two-tier store, and the break-even bandwidth of shipping K/V against recomputing it.
Oracles: the keys written out here over chapter 7's chained hash, kvlib's `TieredStore` (two
memory tiers) and `kvlib.offload.breakeven`."""

from __future__ import annotations

import hashlib
import math

import torch

from kvlib.cache.block_pool import hash_block_tokens
from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import (
    Submission,
    expect_list,
    question,
)
from kvlib.offload.breakeven import break_even_bandwidth
from kvlib.offload.store import MemoryTier, TieredStore


def _keys(salt: bytes, token_ids, block_size, *, chained=True, full_only=True):
    """The keys written out. The common mistakes, switchable: `chained=False` hashes each block
    without its parent, `full_only=False` keys a partial last block too; an empty salt (b"")
    leaves it out."""
    keys, parent = [], None
    blocks = len(token_ids) // block_size if full_only else -(-len(token_ids) // block_size)
    for i in range(blocks):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent if chained else None, block)
        keys.append(hashlib.sha256(salt + parent).digest())
    return keys


def _keys_mistakes(salt: bytes, token_ids, block_size) -> dict:
    """salted_block_keys's common mistakes, from the chapter's pitfalls 1 (an unsalted key), 2 (a
    block reused at another offset) and 3 (a partial last block cached)."""
    args = (token_ids, block_size)
    return {
        "the salt left out: sha256(salt + chained hash), or two models share keys": lambda: _keys(
            b"", *args
        ),
        "each block hashed without its parent: the chained hash covers the whole prefix": lambda: (
            _keys(salt, *args, chained=False)
        ),
        "a key for the partial last block: only full blocks get keys": lambda: _keys(
            salt, *args, full_only=False
        ),
    }


def _random_keys_case(rng) -> tuple:
    """A random salt, up to five blocks of token ids, and the block size."""
    block_size = int(rng.choice([2, 4, 16]))
    tokens = rng.integers(0, 50_000, size=int(rng.integers(0, 5 * block_size))).tolist()
    return bytes(rng.integers(0, 256, size=32).tolist()), tokens, block_size, "a random case"


@question(function="salted_block_keys", allowed=("kvlib.cache.block_pool.hash_block_tokens",))
def test_salted_block_keys(submission: Submission) -> None:
    salted_block_keys = submission.function("salted_block_keys")
    rng = submission.rng()  # random cases are drawn afresh on every run
    salt = hashlib.sha256(b"course model / float32").digest()
    fixed = [
        (salt, list(range(8)), 4, "two full blocks"),
        (salt, list(range(10)), 4, "a partial last block (it gets no key)"),
        (salt, [5, 6, 7], 4, "fewer tokens than a block"),
        (b"another salt", list(range(8)), 4, "the same tokens under another salt"),
        (salt, [1, 2, 3, 4, 1, 2, 3, 4], 4, "the same block at two offsets"),
    ]
    for salt_, tokens, block_size, what in [
        *submission.fixed(fixed),
        *(_random_keys_case(rng) for _ in range(3)),
    ]:
        expected = _keys(salt_, tokens, block_size)
        got = salted_block_keys(salt_, list(tokens), block_size)
        expect_list(
            got, lambda k: isinstance(k, bytes), "salted_block_keys should return a list of bytes"
        )
        wrong = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
        with naming_mistakes(got, _keys_mistakes(salt_, tokens, block_size)):
            assert len(got) == len(expected), (
                f"{what} ({len(tokens)} tokens, block size {block_size}): expected "
                f"{len(expected)} keys (one per full block, none for a partial one), got "
                f"{len(got)}"
            )
            assert not wrong, (
                f"{what} ({len(tokens)} tokens, block size {block_size}): key {wrong[0]} "
                f"differs; each key is sha256(salt + the block's chained hash), the chained hash "
                f"being hash_block_tokens(previous block's chained hash, the block's tokens), "
                f"None before the first block"
            )


def _lru(host_blocks, disk_blocks, operations):
    """kvlib's TieredStore, both tiers in memory, every block 4 bytes."""
    store = TieredStore(
        [MemoryTier("host", 4 * host_blocks, 1.0), MemoryTier("disk", 4 * disk_blocks, 1.0)]
    )
    payload = {"x": torch.zeros(1)}
    found = []
    for op, key in operations:
        if op == "put":
            store.put(key.encode(), payload)
        else:
            hit = store.get(key.encode())
            found.append(None if hit is None else store.tiers[hit[0]].name)
    return (
        found,
        [k.decode() for k in store.tiers[0].keys()],
        [k.decode() for k in store.tiers[1].keys()],
    )


def _lru_written(host_blocks, disk_blocks, operations, *, refresh=True, promote=True,
                 move=True):  # fmt: skip
    """Two LRU lists written out (`_lru`). The common mistakes, switchable: `refresh=False` leaves
    a host hit where it is, `promote=False` leaves a disk hit on disk, `move=False` puts a stored
    key in host memory again without taking it out of its tier (two copies)."""
    host, disk, found = [], [], []

    def insert(key):
        host.append(key)
        if len(host) > host_blocks:
            disk.append(host.pop(0))
            if len(disk) > disk_blocks:
                disk.pop(0)

    for op, key in operations:
        where = "host" if key in host else "disk" if key in disk else None
        if op == "get":
            found.append(where)
            if (where == "host" and refresh) or (where == "disk" and promote):
                (host if where == "host" else disk).remove(key)
                insert(key)
        else:
            if where is not None and move:
                (host if where == "host" else disk).remove(key)
            insert(key)
    return found, host, disk


def _lru_mistakes(host_blocks, disk_blocks, operations) -> dict:
    """two_tier_lru's common mistakes."""
    args = (host_blocks, disk_blocks, operations)
    return {
        "a hit in host memory left where it was: a hit makes the block the newest": lambda: (
            _lru_written(*args, refresh=False)
        ),
        "a hit on disk left on disk: it is promoted to host memory, as the newest": lambda: (
            _lru_written(*args, promote=False)
        ),
        "a put of a stored key leaves the old copy: the key moves, one copy in one tier": lambda: (
            _lru_written(*args, move=False)
        ),
    }


def _random_lru_case(rng) -> tuple:
    """Random tier sizes and 10 to 29 random puts and gets of keys A to F."""
    operations = [
        (str(rng.choice(["put", "get"])), str(rng.choice(list("ABCDEF"))))
        for _ in range(int(rng.integers(10, 30)))
    ]
    return int(rng.integers(1, 4)), int(rng.integers(1, 5)), operations, "a random case"


@question(function="two_tier_lru")
def test_two_tier_lru(submission: Submission) -> None:
    two_tier_lru = submission.function("two_tier_lru")
    rng = submission.rng()  # random cases are drawn afresh on every run
    puts = [("put", k) for k in "ABCDE"]
    fixed = [
        (2, 2, puts, "five puts: the oldest fall to disk, then off it"),
        (2, 3, puts + [("get", "B"), ("get", "A"), ("get", "E")], "hits in each tier, a miss"),
        (1, 2, [("put", "A"), ("put", "B"), ("put", "A"), ("get", "B")], "a put of a disk key"),
        (2, 2, puts[:3] + [("get", "A"), ("put", "D")], "a promoted block is the newest"),
        (2, 2, puts[:2] + [("get", "A"), ("put", "C")], "a host hit makes the block the newest"),
        (2, 2, puts[:2] + [("put", "A"), ("put", "C")], "a put of a host key refreshes it"),
        (1, 2, puts[:3] + [("get", "B")], "a promotion into full tiers"),
    ]
    for host, disk, operations, what in [
        *submission.fixed(fixed),
        *(_random_lru_case(rng) for _ in range(6)),
    ]:
        expected = _lru(host, disk, operations)
        got = two_tier_lru(host, disk, list(operations))
        assert isinstance(got, tuple) and len(got) == 3, (
            f"two_tier_lru should return (found, host_keys, disk_keys), got {got!r}"
        )
        got = (list(got[0]), list(got[1]), list(got[2]))
        with naming_mistakes(got, _lru_mistakes(host, disk, operations), expected=expected):
            assert got == expected, (
                f"{what}: host holds {host} blocks, disk {disk}, operations {operations}: "
                f"expected found {expected[0]}, host {expected[1]}, disk {expected[2]} (least "
                f"recently used first; a put or a hit makes a block the newest in host memory; "
                f"host's oldest falls to disk, disk's oldest is dropped), got found {got[0]}, "
                f"host {got[1]}, disk {got[2]}"
            )


_FIELDS = (  # the config.json keys of L, d, I, H, H_kv, D (book/notation.md)
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
_CONFIGS = [  # (L, d, I, H, H_kv, D), what
    ((30, 576, 1536, 9, 3, 64), "SmolLM2-135M"),
    ((32, 4096, 14336, 32, 8, 128), "Llama 3 8B"),
    ((4, 128, 352, 4, 4, 32), "the course model (MHA)"),
    ((26, 2304, 9216, 8, 4, 256), "a config whose head_dim (256) is not hidden_size / heads (288)"),
]


def _gbps(config, n, flops, *, causal=True, kv=2, head_dim=None, giga=1e9) -> float:
    """The break-even bandwidth written out, with the common mistakes switchable: `causal`
    False counts the full n x n attention; `kv` 1 moves K only; `head_dim` replaces the config's;
    `giga` 2**30 gives GiB/s."""
    layers, d, inter = (config[k] for k in ("num_hidden_layers", "hidden_size",
                                            "intermediate_size"))  # fmt: skip
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["head_dim"] if head_dim is None else head_dim
    moved = kv * layers * kv_heads * dim * 2 * n  # bf16
    linear = 2 * n * layers * (d * heads * dim + 2 * d * kv_heads * dim + heads * dim * d
                               + 3 * d * inter)  # fmt: skip
    pairs = n * (n + 1) if causal else 2 * n * n
    return moved * flops / (linear + 2 * layers * heads * dim * pairs) / giga


def _break_even_mistakes(config, n, flops) -> dict:
    return {
        "GiB/s (2**30 bytes/s), not GB/s (1e9 bytes/s)": lambda: _gbps(
            config, n, flops, giga=2**30
        ),
        "K only: the prefill engine sends V too": lambda: _gbps(config, n, flops, kv=1),
        "the full n x n attention: a causal prefill computes only n (n + 1) / 2 pairs": lambda: (
            _gbps(config, n, flops, causal=False)
        ),
        "head_dim taken as hidden_size / num_attention_heads: use the config's head_dim": (
            lambda: _gbps(
                config, n, flops, head_dim=config["hidden_size"] // config["num_attention_heads"]
            )
        ),
    }


@question(function="break_even_gbps")
def test_break_even_gbps(submission: Submission) -> None:
    break_even_gbps = submission.function("break_even_gbps")
    rng = submission.rng()
    cases = submission.fixed(
        (dict(zip(_FIELDS, c)), n, 400e12, what) for c, what in _CONFIGS for n in (1, 4096)
    )
    for _ in range(3):
        heads = int(rng.choice([4, 8, 16]))
        config = dict(
            num_hidden_layers=int(rng.integers(2, 40)),
            hidden_size=int(rng.integers(2, 17)) * 128,  # head_dim need not be hidden / heads
            intermediate_size=int(rng.integers(1, 8)) * 512,
            num_attention_heads=heads,
            num_key_value_heads=int(rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0])),
            head_dim=int(rng.choice([48, 80, 256])),
        )
        flops = float(rng.choice([100e12, 400e12, 1000e12]))
        cases.append((config, int(rng.integers(1, 20_000)), flops, "a random config"))
    for config, n, flops, what in cases:
        config_ = dict(config, model_type="llama", torch_dtype="bfloat16")
        expected = break_even_bandwidth(config_, n, flops) / 1e9
        got = break_even_gbps(dict(config), n, flops)
        assert isinstance(got, int | float) and math.isfinite(got), (
            f"break_even_gbps should return a finite number (GB/s), got {got!r}"
        )
        with naming_mistakes(got, _break_even_mistakes(config, n, flops), rtol=1e-9, atol=0.0):
            assert math.isclose(got, expected, rel_tol=1e-9), (
                f"{what}, {n} tokens at {flops:.3g} FLOP/s: expected {expected:.6g} GB/s "
                f"(bytes = 2 · L · H_kv · D · 2 (bf16) · n; FLOPs = 2 · n · L · (d·H·D + "
                f"2·d·H_kv·D + H·D·d + 3·d·I) + 2 · L · H · D · n · (n + 1); bandwidth = bytes · "
                f"FLOP/s / FLOPs, in GB/s = 1e9 bytes/s), got {got:.6g}"
            )
