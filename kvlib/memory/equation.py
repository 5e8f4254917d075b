"""The KV-cache memory equation over a model's layers: bytes for a batch of sequences, with a
per-layer report (chapter 3). Per layer: elements per token x tokens held x dtype bytes, plus any
constant SSM state; summed over layers and multiplied by the batch.
"""

from __future__ import annotations

import dataclasses
import math

from kvlib._validate import check_positive_int
from kvlib.config import (
    DTYPE_BITS,
    attention_geometry,
    config_dtype,
    load_config,
    normalize_dtype,
)
from kvlib.errors import UnsupportedConfigError
from kvlib.memory.layers import LayerSpec, _with_sinks, layer_specs

# A config without a dtype field (the original GPT-2's, for one) loads in float32 in transformers,
# whose `from_pretrained` uses torch's default dtype unless the config or caller names another.
DEFAULT_DTYPE = "float32"


def _dtypes(config: dict, cache_dtype: str | None) -> tuple[str, str, str | None]:
    """(cache dtype, SSM state dtype, assumption): the cache in `cache_dtype`, else the config's
    dtype, else float32 as transformers loads such a checkpoint (then `assumption` says so); SSM
    states in the model's dtype (the config's; else `cache_dtype`)."""
    model_dtype = config_dtype(config)
    if cache_dtype is not None:
        cache_dtype = normalize_dtype(cache_dtype)
        return cache_dtype, model_dtype or cache_dtype, None
    if model_dtype is None:
        assumption = f"the config names no dtype: {DEFAULT_DTYPE} assumed, as transformers loads it"
        return DEFAULT_DTYPE, DEFAULT_DTYPE, assumption
    return model_dtype, model_dtype, None


@dataclasses.dataclass
class LayerUsage:
    spec: LayerSpec
    tokens_held: int
    bytes: int


@dataclasses.dataclass
class CacheReport:
    """A per-layer breakdown of `kv_cache_bytes`: bytes for `batch_size` sequences of `seq_len`
    tokens."""

    model_type: str
    seq_len: int
    batch_size: int
    cache_dtype: str
    state_dtype: str | None
    layers: list[LayerUsage]
    dtype_assumption: str | None = None  # set when the config named no dtype

    @property
    def total_bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    def table(self) -> str:
        """Readable text: one row per group of identical layers, then the total."""
        groups: dict[tuple, list[LayerUsage]] = {}
        for usage in self.layers:
            groups.setdefault((usage.spec.kind, usage.bytes, usage.spec.description), []).append(
                usage
            )
        rows = []
        for (kind, layer_bytes, description), members in groups.items():
            spec = members[0].spec
            holds = (
                f"{members[0].tokens_held} tok"
                if spec.elements_per_token
                else "state"
                if spec.state_elements
                else "nothing"
            )
            rows.append(
                (
                    f"{len(members)}: {_ranges([m.spec.index for m in members])}",
                    kind,
                    holds,
                    format_bytes(layer_bytes),
                    format_bytes(layer_bytes * len(members)),
                    description,
                )
            )
        titles = ("layers", "kind", "holds", "per layer", "subtotal")
        widths = [max(len(r[k]) for r in rows + [titles]) for k in range(5)]
        kinds = {u.spec.kind for u in self.layers if u.spec.state_elements}
        states = ("SSM state" if kinds & {"mamba", "mamba2"} else "state") if kinds else ""
        lines = [
            f"{self.model_type}: {self.batch_size} x {self.seq_len} tokens, cache "
            f"{self.cache_dtype}"
            + (f", {states} {self.state_dtype}" if states else "")
            + (f" ({self.dtype_assumption})" if self.dtype_assumption else ""),
            "  ".join(t.ljust(w) for t, w in zip(titles, widths)) + "  derivation",
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
        lines.append(f"total: {format_bytes(self.total_bytes)} ({self.total_bytes:,} bytes)")
        return "\n".join(lines)


def _ranges(indices: list[int], max_chars: int = 24) -> str:
    """[0, 1, 2, 4] -> '0-2,4', shortened with '...' past `max_chars`."""
    parts, start = [], indices[0]
    for previous, current in zip(indices, indices[1:] + [None]):
        if current != previous + 1 if current is not None else True:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    text = ",".join(parts)
    return text if len(text) <= max_chars else text[: max_chars - 3].rsplit(",", 1)[0] + ",..."


def cache_report(
    config,
    seq_len: int,
    batch_size: int = 1,
    cache_dtype: str | None = None,
    *,
    sink_tokens: int = 0,
    sink_window: int | None = None,
) -> CacheReport:
    """`kv_cache_bytes` with its per-layer breakdown. Arguments as for `kv_cache_bytes`."""
    config = load_config(config)
    seq_len = check_positive_int("seq_len", seq_len)
    batch_size = check_positive_int("batch_size", batch_size)
    cache_dtype, state_dtype, dtype_assumption = _dtypes(config, cache_dtype)
    specs = _with_sinks(layer_specs(config), sink_tokens, sink_window)
    usage = []
    for spec in specs:
        held = spec.tokens_held(seq_len) if spec.elements_per_token else 0
        bits = spec.elements_per_token * held * DTYPE_BITS[cache_dtype]
        if spec.state_elements:
            bits += spec.state_elements * DTYPE_BITS[state_dtype]
        usage.append(LayerUsage(spec, held, batch_size * math.ceil(bits / 8)))
    return CacheReport(
        config["model_type"], seq_len, batch_size, cache_dtype, state_dtype, usage, dtype_assumption
    )


def kv_cache_bytes(
    config, seq_len: int, batch_size: int = 1, cache_dtype: str | None = None, **sinks
) -> int:
    """Bytes of cache state for `batch_size` sequences that have `seq_len` tokens each.

    Windows and chunks applied, constant SSM states included. Per attention layer and sequence:
    `elements_per_token · min(seq_len, cap) · bits / 8`; per SSM layer: its state.

    Args:
        config: a Hugging Face config (dict or path to config.json).
        seq_len: tokens per sequence (>= 1).
        batch_size: sequences (>= 1).
        cache_dtype: float64, float32, bfloat16, float16, fp8, int8 or int4 (payload only, no
            scales); None = the config's `torch_dtype`/`dtype`.
        sinks: `sink_tokens` (default 0) and `sink_window` (default None): StreamingLLM (Xiao et
            al., 2024), each attention layer keeps its first `sink_tokens` tokens and the last
            `sink_window`.
    Returns:
        bytes (int).
    Raises:
        UnsupportedConfigError, TypeError, ValueError: see `layer_specs`; non-positive sizes; an
        unknown dtype; no dtype in the config and none given.
    """
    return cache_report(config, seq_len, batch_size, cache_dtype, **sinks).total_bytes


def kv_bytes_per_token(config, cache_dtype: str | None = None) -> int:
    """Bytes each new token adds to one sequence's cache before any window or chunk cap:
    `Σ_layers elements_per_token · bits / 8` (0 for a pure SSM). Independent of context length.
    """
    config = load_config(config)
    cache_dtype, _, _ = _dtypes(config, cache_dtype)
    return math.ceil(
        sum(s.elements_per_token for s in layer_specs(config)) * DTYPE_BITS[cache_dtype] / 8
    )


def quantized_kv_cache_bytes(
    config, seq_len: int, key_scheme, value_scheme=None, batch_size: int = 1
) -> int:
    """`kv_cache_bytes` for a quantized cache (chapter 10): per attention layer, per token held,
    `H_kv · (key_scheme.bytes_per_vector(D) + value_scheme.bytes_per_vector(D))`: the codes
    plus the scales and zero points (`kvlib.quant.QuantScheme`; any object with that method).

    Raises:
        UnsupportedConfigError: a model with MLA or SSM layers (their caches are not K/V heads);
        as `kv_cache_bytes` otherwise.
    """
    config = load_config(config)
    seq_len = check_positive_int("seq_len", seq_len, allow_zero=True)
    batch_size = check_positive_int("batch_size", batch_size)
    value_scheme = key_scheme if value_scheme is None else value_scheme
    specs = layer_specs(config)
    others = sorted({s.kind for s in specs if s.kind not in ("full", "sliding", "chunked")})
    if others:
        raise UnsupportedConfigError(
            f"config: quantized K/V bytes cover attention layers with K/V heads, not {others}"
        )
    num_kv_heads, head_dim, _ = attention_geometry(config, config.get("model_type", ""))
    per_token = num_kv_heads * (
        key_scheme.bytes_per_vector(head_dim) + value_scheme.bytes_per_vector(head_dim)
    )
    return math.ceil(batch_size * per_token * sum(s.tokens_held(seq_len) for s in specs))


def format_bytes(num_bytes: float) -> str:
    """Binary units: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")
