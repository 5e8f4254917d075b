"""What each layer of a model caches per sequence, read from its config the way each model's own
code reads it (chapter 3). Layer by layer:


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
- linear-attention layers of a hybrid (Qwen3-Next's Gated DeltaNet layers, Yang et al., 2024): a
  constant state per sequence, the recurrent state `H_v · D_k · D_v` plus the short convolution's
  last `linear_conv_kernel_dim` inputs, the shapes transformers' linear-attention cache keeps
  (kvlib's own hybrids, `kvlib.layers.hybrid`, list linear layers in any model type's
  `layer_types` and have no convolution: no `linear_conv_kernel_dim`, no convolution state);
- cross-layer KV sharing (Brandon et al., 2024; Gemma 3n's `num_kv_shared_layers`): the last
  layers read the cache of the last layer of their own kind before the sharing starts and cache
  nothing themselves (kind "shared"; transformers' `Gemma3nTextAttention.kv_shared_layer_index`,
  commit b87ecf8c);
- StreamingLLM attention sinks (Xiao et al., 2024), on request: every attention layer keeps its
  first `sink_tokens` tokens plus a recent window.

What it deliberately does not do: guess. A missing field, a model type whose layer pattern it does
not know, or a config feature that would change the answer raise errors that name the field and
the model type. It counts the cache payload only: quantization scales, paging slack and allocator
overheads are chapters 7 and 10.
"""

from __future__ import annotations

import dataclasses
import os

from kvlib._validate import check_positive_int
from kvlib.config import attention_geometry, config_field, load_config
from kvlib.errors import UnsupportedConfigError
from kvlib.memory.formula import kv_elements_per_token

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
    "gemma3n_text",
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
HYBRID = {"jamba", "qwen3_next"}
SIZED_MODEL_TYPES = sorted(DENSE_ATTENTION | MLA | SSM | HYBRID)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one layer caches for one sequence.

    kind: "full", "sliding", "chunked", "mla", "mamba", "mamba2", "linear" (a linear-attention
        layer's fixed state) or "shared" (reads an earlier layer's cache, holds none).
    elements_per_token: cached elements each new token adds (K and V together; the latent for MLA).
    token_cap: the most tokens the layer keeps (window or chunk size); None = unbounded.
    state_elements: constant elements per sequence (SSM convolution + SSM state); 0 for attention.
    description: how the numbers were derived, for reports.
    reads: for a "shared" layer, the index of the layer whose cache it reads; None otherwise.
    """

    index: int
    kind: str
    elements_per_token: int
    token_cap: int | None
    state_elements: int
    description: str
    reads: int | None = None

    def tokens_held(self, seq_len: int) -> int:
        """Tokens this layer holds after `seq_len` tokens."""
        return seq_len if self.token_cap is None else min(seq_len, self.token_cap)


def _model_type(config: dict) -> str:
    model_type = config.get("model_type")
    if not model_type:
        raise UnsupportedConfigError(
            "config: missing field 'model_type' (needed to know how the model reads its config)"
        )
    if model_type not in SIZED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"config: model_type {model_type!r} is not supported; kvlib.memory sizes: "
            f"{', '.join(SIZED_MODEL_TYPES)}"
        )
    return model_type


def _attention_kinds(config: dict, model_type: str, num_layers: int) -> list[str]:
    """Per layer: "full", "sliding" or "chunked", as the model's own code decides."""
    if config.get("layer_types") is not None:
        names = {
            "full_attention": "full",
            "sliding_attention": "sliding",
            "chunked_attention": "chunked",
        }
        layer_types = config["layer_types"]
        if model_type == "qwen3_next" or "linear_attention" in layer_types:  # kvlib's hybrids too
            names["linear_attention"] = "linear"
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
    if model_type == "qwen3_next":  # every `full_attention_interval`-th layer is full attention
        interval = int(config.get("full_attention_interval", 4))
        return ["linear" if (i + 1) % interval else "full" for i in range(num_layers)]
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
        hidden, expand = config_field(config, "hidden_size"), config_field(config, "expand")
        state, conv, groups = (
            config_field(config, "state_size"),
            config_field(config, "conv_kernel"),
            config_field(config, "n_groups"),
        )
        heads, head_dim = config_field(config, "num_heads"), config_field(config, "head_dim")
        conv_dim = expand * hidden + 2 * groups * state
        return (
            conv_dim * conv + heads * head_dim * state,
            f"Mamba-2 state: conv {conv_dim}x{conv} + ssm {heads}x{head_dim}x{state}",
        )
    if model_type == "jamba":
        inner = config_field(config, "mamba_expand") * config_field(config, "hidden_size")
        conv, state = config_field(config, "mamba_d_conv"), config_field(config, "mamba_d_state")
    else:  # MambaCache: conv (intermediate, K), ssm (intermediate, N)
        inner = (
            config_field(config, "intermediate_size")
            if config.get("intermediate_size")
            else config_field(config, "expand") * config_field(config, "hidden_size")
        )
        conv, state = config_field(config, "conv_kernel"), config_field(config, "state_size")
    return inner * (conv + state), f"Mamba state: conv {inner}x{conv} + ssm {inner}x{state}"


def _linear_attention_state(config: dict) -> tuple[int, str]:
    """Constant state elements per sequence of one Gated DeltaNet layer (Qwen3-Next): the
    recurrent state (value heads, D_k, D_v) plus the causal convolution's window over the mixed
    q, k, v channels (conv_dim, kernel), as transformers' linear-attention cache allocates them."""
    key_heads, value_heads = (
        config_field(config, "linear_num_key_heads"),
        config_field(config, "linear_num_value_heads"),
    )
    d_k, d_v = (
        config_field(config, "linear_key_head_dim"),
        config_field(config, "linear_value_head_dim"),
    )
    state, how = value_heads * d_k * d_v, f"linear-attention state: {value_heads}x{d_k}x{d_v}"
    if config.get("model_type") != "qwen3_next" and config.get("linear_conv_kernel_dim") is None:
        return state, how + " (no convolution)"  # kvlib's hybrids (kvlib.layers.hybrid)
    kernel = config_field(config, "linear_conv_kernel_dim")
    conv_dim = 2 * key_heads * d_k + value_heads * d_v
    return state + conv_dim * kernel, f"{how} + conv {conv_dim}x{kernel}"


def _shared(specs: list[LayerSpec], config: dict) -> list[LayerSpec]:
    """Cross-layer KV sharing as Gemma 3n configures it: each of the last `num_kv_shared_layers`
    layers reads the cache of the last layer of its own kind before them and stores nothing."""
    shared = int(config.get("num_kv_shared_layers") or 0)
    first = len(specs) - shared
    if not 0 <= shared < len(specs):
        raise UnsupportedConfigError(
            f"config: num_kv_shared_layers must be in [0, {len(specs)}), got {shared}"
        )
    out = list(specs[:first])
    for spec in specs[first:]:
        producers = [s.index for s in specs[:first] if s.kind == spec.kind]
        if not producers:
            raise UnsupportedConfigError(
                f"config: shared layer {spec.index} ({spec.kind}) has no earlier {spec.kind} layer"
            )
        how = f"reads layer {producers[-1]}'s {spec.kind} cache (cross-layer sharing)"
        out.append(LayerSpec(spec.index, "shared", 0, None, 0, how, reads=producers[-1]))
    return out


def layer_specs(config: dict | str | os.PathLike) -> list[LayerSpec]:
    """What every layer of the model caches, in layer order.

    Raises:
        UnsupportedConfigError: an unknown model type (the message lists the supported ones), a
            missing field (named, with the model type), or a pattern kvlib would have to guess.
    """
    config = load_config(config)
    model_type = _model_type(config)
    num_layers = config_field(config, "num_hidden_layers", "n_layer", "num_layers")
    if model_type in SSM:
        state, how = _mamba_state(config, model_type)
        return [LayerSpec(i, model_type, 0, None, state, how) for i in range(num_layers)]
    if model_type in MLA:
        latent = config_field(config, "kv_lora_rank") + config_field(config, "qk_rope_head_dim")
        how = (
            f"MLA latent: kv_lora_rank {config['kv_lora_rank']} + "
            f"qk_rope_head_dim {config['qk_rope_head_dim']}"
        )
        return [LayerSpec(i, "mla", latent, None, 0, how) for i in range(num_layers)]
    if model_type == "jamba":
        period, offset = (
            config_field(config, "attn_layer_period"),
            int(config.get("attn_layer_offset", 0)),
        )
        kv_heads, head_dim, how = attention_geometry(config, model_type)
        state, state_how = _mamba_state(config, model_type)
        return [
            LayerSpec(i, "full", kv_elements_per_token(kv_heads, head_dim), None, 0, how)
            if i % period == offset
            else LayerSpec(i, "mamba", 0, None, state, state_how)
            for i in range(num_layers)
        ]
    kv_heads, head_dim, how = attention_geometry(config, model_type)
    specs = []
    for i, kind in enumerate(_attention_kinds(config, model_type, num_layers)):
        if kind == "linear":
            specs.append(LayerSpec(i, "linear", 0, None, *_linear_attention_state(config)))
            continue
        if kind == "full":
            cap, note = None, ""
        elif kind == "sliding":
            cap = config_field(config, "sliding_window")
            note = f", window {cap}"
        else:
            cap = config_field(config, "attention_chunk_size")
            note = f", chunk {cap}"
        specs.append(
            LayerSpec(i, kind, kv_elements_per_token(kv_heads, head_dim), cap, 0, how + note)
        )
    return _shared(specs, config) if config.get("num_kv_shared_layers") else specs


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
