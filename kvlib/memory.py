"""How many bytes a model's cache holds: the KV-cache memory equation for real architectures,
read from a Hugging Face `config.json` the way each model's own code reads it.

What it does: decides, layer by layer, what each layer keeps per sequence:

- full attention (MHA / GQA / MQA): `2 · H_kv · D` elements per token, growing without bound.
  `H_kv` comes from `num_key_value_heads` (or a model's own flags: Falcon's `multi_query`,
  `new_decoder_architecture`); `D` from an explicit `head_dim` when the config has one;
- sliding-window and chunked layers: the same per token, but capped at the window / chunk size
  (`sliding_window`, `layer_types`, Gemma's alternating patterns, Qwen2's `use_sliding_window`);
- MLA (DeepSeek-V2/V3): one compressed latent of `kv_lora_rank + qk_rope_head_dim` elements per
  token **per layer**, the cache DeepSeek's inference keeps (DeepSeek-AI, 2024, DeepSeek-V2, sec.
  2.1);
- SSM layers (Mamba, Mamba-2, Jamba's Mamba layers): a constant state per sequence, convolution
  state plus SSM state, in the shapes Hugging Face's Mamba caches allocate;
- StreamingLLM attention sinks (Xiao et al., 2024), on request: every attention layer keeps its
  first `sink_tokens` tokens plus a recent window.

What it deliberately does not do: guess. A missing field, a model type whose layer pattern it does
not know, or a config feature that would change the answer raise errors that name the field and
the model type. It counts the cache payload only: quantization scales, paging slack and allocator
overheads are chapters 7 and 10.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

from kvlib._validate import check_positive_int
from kvlib.errors import UnsupportedConfigError

DTYPE_BITS = {
    "float64": 64,
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
}
_DTYPE_ALIASES = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}

# Model types whose layer pattern kvlib reads (anything else raises, listing these).
DENSE_ATTENTION = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "gpt2",
    "opt",
    "falcon",
    "gpt_neox",
    "olmo",
    "olmo2",
    "gpt_oss",
}
MLA = {"deepseek_v2", "deepseek_v3"}
SSM = {"mamba", "mamba2"}
HYBRID = {"jamba"}
SUPPORTED_MODEL_TYPES = sorted(DENSE_ATTENTION | MLA | SSM | HYBRID)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one layer caches for one sequence.

    kind: "full", "sliding", "chunked", "mla", "mamba" or "mamba2".
    elements_per_token: cached elements each new token adds (K and V together; the latent for MLA).
    token_cap: the most tokens the layer keeps (window or chunk size); None = unbounded.
    state_elements: constant elements per sequence (SSM convolution + SSM state); 0 for attention.
    description: how the numbers were derived, for reports.
    """

    index: int
    kind: str
    elements_per_token: int
    token_cap: int | None
    state_elements: int
    description: str

    def tokens_held(self, seq_len: int) -> int:
        """Tokens this layer holds after `seq_len` tokens."""
        return seq_len if self.token_cap is None else min(seq_len, self.token_cap)


# --- reading configs ------------------------------------------------------------------------------


def load_config(config: dict | str | os.PathLike) -> dict:
    """The text model's config as a dict: from a path or a dict; a multimodal config's `text_config`
    is merged over its top level (so a top-level `torch_dtype` still applies).

    Raises:
        FileNotFoundError: no such file. TypeError: neither a dict nor a path. ValueError: not JSON.
    """
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"config: no such file {path}")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"config: {path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise TypeError(
            f"config: expected a dict or a path to config.json, got {type(config).__name__}"
        )
    text = config.get("text_config")
    if isinstance(text, dict):
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(text)
        merged.setdefault("_outer_model_type", config.get("model_type"))
        return merged
    return dict(config)


def _model_type(config: dict) -> str:
    model_type = config.get("model_type")
    if not model_type:
        raise UnsupportedConfigError(
            "config: missing field 'model_type' (needed to know how the model reads its config)"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"config: model_type {model_type!r} is not supported; kvlib.memory sizes: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def _field(config: dict, *names: str) -> int:
    """The first of `names` present (and not null) in the config, as a positive int."""
    for name in names:
        if config.get(name) is not None:
            return check_positive_int(f"config[{name!r}]", config[name])
    raise UnsupportedConfigError(
        f"config: missing field {' / '.join(repr(n) for n in names)} for model_type "
        f"{config.get('model_type')!r}"
    )


def config_dtype(config: dict) -> str | None:
    """The dtype the config names (`torch_dtype` in transformers 4.x, `dtype` in 5.x), normalised,
    or None."""
    for name in ("dtype", "torch_dtype"):
        if config.get(name):
            return normalize_dtype(str(config[name]), argument=f"config[{name!r}]")
    return None


def normalize_dtype(dtype: str, *, argument: str = "cache_dtype") -> str:
    """A dtype name as one of DTYPE_BITS's keys ("bf16" -> "bfloat16", "torch.float16" ->
    "float16")."""
    name = str(dtype).lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BITS:
        raise ValueError(f"{argument}: expected one of {', '.join(DTYPE_BITS)}, got {dtype!r}")
    return name


def _attention_geometry(config: dict, model_type: str) -> tuple[int, int, str]:
    """(H_kv, D, description) of a dense attention layer."""
    heads = _field(config, "num_attention_heads", "n_head")
    if model_type == "falcon":  # Falcon's own flags decide the KV heads
        if config.get("new_decoder_architecture"):
            kv_heads, how = (
                _field(config, "num_kv_heads"),
                "num_kv_heads (new_decoder_architecture)",
            )
        elif config.get("multi_query", True):
            kv_heads, how = 1, "multi_query"
        else:
            kv_heads, how = heads, "num_attention_heads (multi_query false)"
    elif config.get("num_key_value_heads") is not None:
        kv_heads, how = _field(config, "num_key_value_heads"), "num_key_value_heads"
    else:
        kv_heads, how = heads, "num_attention_heads (no num_key_value_heads: MHA)"
    if heads % kv_heads:
        raise UnsupportedConfigError(
            f"config: num_attention_heads {heads} is not a multiple of the {kv_heads} KV heads "
            f"({how})"
        )
    if config.get("head_dim") is not None:
        head_dim, dim_how = _field(config, "head_dim"), "head_dim"
    else:
        hidden = _field(config, "hidden_size", "n_embd", "d_model")
        if hidden % heads:
            raise UnsupportedConfigError(
                f"config: hidden size {hidden} is not divisible by {heads} heads and there is no "
                "head_dim"
            )
        head_dim, dim_how = hidden // heads, f"hidden {hidden} / {heads} heads"
    family = "MHA" if kv_heads == heads else "MQA" if kv_heads == 1 else "GQA"
    return (
        kv_heads,
        head_dim,
        f"{family}: 2 x {kv_heads} KV heads ({how}) x D={head_dim} ({dim_how})",
    )


def _attention_kinds(config: dict, model_type: str, num_layers: int) -> list[str]:
    """Per layer: "full", "sliding" or "chunked", as the model's own code decides."""
    if config.get("layer_types") is not None:
        names = {
            "full_attention": "full",
            "sliding_attention": "sliding",
            "chunked_attention": "chunked",
        }
        layer_types = config["layer_types"]
        if len(layer_types) != num_layers or any(t not in names for t in layer_types):
            raise UnsupportedConfigError(
                f"config: layer_types must list {num_layers} of {sorted(names)}, got "
                f"{layer_types!r}"
            )
        return [names[t] for t in layer_types]
    window = config.get("sliding_window")
    if model_type in (
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
    ):  # sliding only if enabled, on layers >= max_window_layers
        if not config.get("use_sliding_window") or window is None:
            return ["full"] * num_layers
        first = int(config.get("max_window_layers", num_layers))
        return ["sliding" if i >= first else "full" for i in range(num_layers)]
    if model_type == "gemma2":  # even layers slide, odd layers are global
        return ["sliding" if (i + 1) % 2 else "full" for i in range(num_layers)]
    if model_type in ("gemma3", "gemma3_text"):  # every `sliding_window_pattern`-th layer is global
        pattern = int(config.get("sliding_window_pattern", 6))
        return ["sliding" if (i + 1) % pattern else "full" for i in range(num_layers)]
    if model_type in ("mistral", "mixtral"):
        return ["full" if window is None else "sliding"] * num_layers
    if window is not None:
        raise UnsupportedConfigError(
            f"config: sliding_window={window} but kvlib does not know which layers of a "
            f"{model_type!r} model slide"
        )
    return ["full"] * num_layers


def _mamba_state(config: dict, model_type: str) -> tuple[int, str]:
    """Constant state elements per sequence of one SSM layer, as Hugging Face's caches allocate
    them."""
    # Mamba2Cache: conv (intermediate + 2 * groups * N, K), ssm (heads, head_dim, N)
    if model_type == "mamba2":
        hidden, expand = _field(config, "hidden_size"), _field(config, "expand")
        state, conv, groups = (
            _field(config, "state_size"),
            _field(config, "conv_kernel"),
            _field(config, "n_groups"),
        )
        heads, head_dim = _field(config, "num_heads"), _field(config, "head_dim")
        conv_dim = expand * hidden + 2 * groups * state
        return (
            conv_dim * conv + heads * head_dim * state,
            f"Mamba-2 state: conv {conv_dim}x{conv} + ssm {heads}x{head_dim}x{state}",
        )
    if model_type == "jamba":
        inner = _field(config, "mamba_expand") * _field(config, "hidden_size")
        conv, state = _field(config, "mamba_d_conv"), _field(config, "mamba_d_state")
    else:  # MambaCache: conv (intermediate, K), ssm (intermediate, N)
        inner = (
            _field(config, "intermediate_size")
            if config.get("intermediate_size")
            else _field(config, "expand") * _field(config, "hidden_size")
        )
        conv, state = _field(config, "conv_kernel"), _field(config, "state_size")
    return inner * (conv + state), f"Mamba state: conv {inner}x{conv} + ssm {inner}x{state}"


def layer_specs(config: dict | str | os.PathLike) -> list[LayerSpec]:
    """What every layer of the model caches, in layer order.

    Raises:
        UnsupportedConfigError: an unknown model type (the message lists the supported ones), a
            missing field (named, with the model type), or a pattern kvlib would have to guess.
    """
    config = load_config(config)
    model_type = _model_type(config)
    num_layers = _field(config, "num_hidden_layers", "n_layer", "num_layers")
    if model_type in SSM:
        state, how = _mamba_state(config, model_type)
        return [LayerSpec(i, model_type, 0, None, state, how) for i in range(num_layers)]
    if model_type in MLA:
        latent = _field(config, "kv_lora_rank") + _field(config, "qk_rope_head_dim")
        how = (
            f"MLA latent: kv_lora_rank {config['kv_lora_rank']} + "
            f"qk_rope_head_dim {config['qk_rope_head_dim']}"
        )
        return [LayerSpec(i, "mla", latent, None, 0, how) for i in range(num_layers)]
    if model_type == "jamba":
        period, offset = (
            _field(config, "attn_layer_period"),
            int(config.get("attn_layer_offset", 0)),
        )
        kv_heads, head_dim, how = _attention_geometry(config, model_type)
        state, state_how = _mamba_state(config, model_type)
        return [
            LayerSpec(i, "full", 2 * kv_heads * head_dim, None, 0, how)
            if i % period == offset
            else LayerSpec(i, "mamba", 0, None, state, state_how)
            for i in range(num_layers)
        ]
    kv_heads, head_dim, how = _attention_geometry(config, model_type)
    specs = []
    for i, kind in enumerate(_attention_kinds(config, model_type, num_layers)):
        if kind == "full":
            cap, note = None, ""
        elif kind == "sliding":
            cap = _field(config, "sliding_window")
            note = f", window {cap}"
        else:
            cap = _field(config, "attention_chunk_size")
            note = f", chunk {cap}"
        specs.append(LayerSpec(i, kind, 2 * kv_heads * head_dim, cap, 0, how + note))
    return specs


def _with_sinks(
    specs: list[LayerSpec], sink_tokens: int, sink_window: int | None
) -> list[LayerSpec]:
    if sink_window is None:
        if sink_tokens:
            raise ValueError(
                "sink_window: StreamingLLM needs a recent-token window along with sink_tokens"
            )
        return specs
    sink_tokens = check_positive_int("sink_tokens", sink_tokens, allow_zero=True)
    sink_window = check_positive_int("sink_window", sink_window)
    capped = []
    for spec in specs:
        if spec.elements_per_token == 0:
            capped.append(spec)
            continue
        cap = (
            sink_tokens + sink_window
            if spec.token_cap is None
            else min(spec.token_cap, sink_tokens + sink_window)
        )
        capped.append(
            dataclasses.replace(
                spec,
                token_cap=cap,
                description=f"{spec.description}, {sink_tokens} sinks + {sink_window} recent",
            )
        )
    return capped


# --- the equation ---------------------------------------------------------------------------------


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
            holds = (
                f"{members[0].tokens_held} tok" if members[0].spec.elements_per_token else "state"
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
        states = any(u.spec.state_elements for u in self.layers)
        lines = [
            f"{self.model_type}: {self.batch_size} x {self.seq_len} tokens, cache "
            f"{self.cache_dtype}"
            + (f", SSM state {self.state_dtype}" if states else "")
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
    config,
    seq_len: int,
    batch_size: int = 1,
    cache_dtype: str | None = None,
    *,
    sink_tokens: int = 0,
    sink_window: int | None = None,
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
        sink_tokens, sink_window: StreamingLLM (Xiao et al., 2024): each attention layer keeps its
            first `sink_tokens` tokens and the last `sink_window`.
    Returns:
        bytes (int).
    Raises:
        UnsupportedConfigError, TypeError, ValueError: see `layer_specs`; non-positive sizes; an
        unknown dtype; no dtype in the config and none given.
    """
    return cache_report(
        config, seq_len, batch_size, cache_dtype, sink_tokens=sink_tokens, sink_window=sink_window
    ).total_bytes


def kv_bytes_per_token(config, cache_dtype: str | None = None) -> int:
    """Bytes each new token adds to one sequence's cache before any window or chunk cap:
    `Σ_layers elements_per_token · bits / 8` (0 for a pure SSM). Independent of context length.
    """
    config = load_config(config)
    cache_dtype, _, _ = _dtypes(config, cache_dtype)
    return math.ceil(
        sum(s.elements_per_token for s in layer_specs(config)) * DTYPE_BITS[cache_dtype] / 8
    )


def format_bytes(num_bytes: float) -> str:
    """Binary units: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


# --- what fits on a GPU ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """The whole-VRAM equation: usable = utilization x GPU memory; what is left after weights,
    runtime overhead and prefill activations holds the KV cache."""

    gpu_memory_bytes: int
    usable_bytes: int
    weight_bytes: int
    runtime_overhead_bytes: int
    activation_bytes: int
    kv_budget_bytes: int
    bytes_per_sequence: int
    max_sequences: int


def prefill_activation_bytes(config, prefill_tokens: int, dtype: str | None = None) -> int:
    """Peak activation memory of one prefill chunk of `prefill_tokens` tokens (an estimate).

    The largest transient tensors of a decoder layer are the gate and up projections of the MLP,
    `2 · tokens · intermediate_size`, alongside the residual stream and attention input/output,
    `4 · tokens · hidden_size`; layers run one after another, so one layer's worth is alive at a
    time. Inference engines measure this instead by profiling a forward pass of their largest
    batch (vLLM's memory profiling before it sizes the KV cache); this estimate is what such a
    profile mostly sees.
    """
    config = load_config(config)
    prefill_tokens = check_positive_int("prefill_tokens", prefill_tokens)
    dtype = normalize_dtype(dtype) if dtype else config_dtype(config)
    if dtype is None:
        raise UnsupportedConfigError("config: no 'torch_dtype'; pass dtype")
    hidden = _field(config, "hidden_size", "n_embd", "d_model")
    intermediate = (
        config.get("intermediate_size")
        or config.get("ffn_dim")
        or config.get("n_inner")
        or 4 * hidden
    )
    return math.ceil(prefill_tokens * (2 * intermediate + 4 * hidden) * DTYPE_BITS[dtype] / 8)


def memory_budget(
    config,
    gpu_memory_bytes: int,
    seq_len: int,
    *,
    weight_bytes: int,
    cache_dtype: str | None = None,
    gpu_memory_utilization: float = 0.9,
    runtime_overhead_bytes: int = 2 * 2**30,
    prefill_tokens: int = 8192,
) -> MemoryBudget:
    """The whole-VRAM equation behind `max_concurrent_sequences`, every term kept.

    Args:
        gpu_memory_bytes: the GPU's memory in bytes (H100 80GB: nvidia-smi reports 81,559 MiB).
        seq_len: tokens each sequence may reach.
        weight_bytes: the model's weights as loaded (parameters x bytes per parameter; quoted from
            the model card: configs do not state parameter counts).
        gpu_memory_utilization: the fraction the engine may use (vLLM's default is 0.9).
        runtime_overhead_bytes: CUDA context, kernels' workspaces, allocator slack, CUDA graphs
            (default 2 GiB, a round figure; measure it on your system).
        prefill_tokens: the largest prefill chunk the engine runs (vLLM's `max_num_batched_tokens`).
    Raises:
        ValueError: the weights and fixed costs do not fit; bad arguments.
    """
    gpu_memory_bytes = check_positive_int("gpu_memory_bytes", gpu_memory_bytes)
    weight_bytes = check_positive_int("weight_bytes", weight_bytes)
    runtime_overhead_bytes = check_positive_int(
        "runtime_overhead_bytes", runtime_overhead_bytes, allow_zero=True
    )
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization: expected a fraction in (0, 1], got {gpu_memory_utilization}"
        )
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    activations = prefill_activation_bytes(config, prefill_tokens)
    budget = usable - weight_bytes - runtime_overhead_bytes - activations
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_bytes: {format_bytes(usable)} usable cannot hold weights "
            f"{format_bytes(weight_bytes)} + overhead "
            f"{format_bytes(runtime_overhead_bytes)} + activations {format_bytes(activations)}"
        )
    per_sequence = kv_cache_bytes(config, seq_len, 1, cache_dtype)
    return MemoryBudget(
        gpu_memory_bytes,
        usable,
        weight_bytes,
        runtime_overhead_bytes,
        activations,
        budget,
        per_sequence,
        budget // per_sequence,
    )


def max_concurrent_sequences(config, gpu_memory_bytes: int, seq_len: int, **kwargs) -> int:
    """How many sequences of `seq_len` tokens fit in the KV budget of one GPU (see `memory_budget`
    for the equation and the keyword arguments, `weight_bytes` among them)."""
    return memory_budget(config, gpu_memory_bytes, seq_len, **kwargs).max_sequences


# --- shipped configs and the command line ---------------------------------------------------------

CONFIG_DIR = Path(__file__).with_name("configs")


def shipped_configs() -> dict[str, dict]:
    """The real models' configs that ship with kvlib (architecture fields only), by file stem."""
    return {path.stem: load_config(path) for path in sorted(CONFIG_DIR.glob("*.json"))}


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.memory CONFIG.json --seq-len N [--batch B] [--cache-dtype D]`."""
    parser = argparse.ArgumentParser(
        prog="python -m kvlib.memory", description="KV-cache bytes for a Hugging Face config.json."
    )
    parser.add_argument(
        "config",
        help="path to config.json, or the name of a shipped config: "
        + ", ".join(p.stem for p in sorted(CONFIG_DIR.glob("*.json"))),
    )
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    parser.add_argument(
        "--cache-dtype",
        default=None,
        help=f"one of {', '.join(DTYPE_BITS)} (default: the config's dtype)",
    )
    args = parser.parse_args(argv)
    path = Path(args.config)
    if not path.exists() and (CONFIG_DIR / f"{args.config}.json").exists():
        path = CONFIG_DIR / f"{args.config}.json"
    try:
        config = load_config(path)  # read once, sized twice
        report = cache_report(config, args.seq_len, args.batch, args.cache_dtype)
        per_token = kv_bytes_per_token(config, args.cache_dtype)
    except (OSError, ValueError, TypeError) as exc:
        parser.error(str(exc))
    print(report.table())
    print(f"growth per token (before caps): {format_bytes(per_token)} ({per_token:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
