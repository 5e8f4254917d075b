"""A decoder-only transformer with the Llama architecture: its configuration and the model.

What it does: the layers of `kvlib.layers.llama` (RMSNorm, RoPE, SwiGLU MLP, attention; no biases
except the q/k/v biases of Qwen2, MHA/GQA/MQA from one code path, `num_key_value_heads`), or MLA's
(`kvlib.layers.mla`), stacked, with an optional sliding window (Mistral) or, with `layer_types`,
a kind per layer: full, sliding-window or gated linear attention (chapter 17's hybrids,
`kvlib.layers.hybrid`). Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.
weight`), so a checkpoint's state dict loads as is. `model(input_ids, cache=...)` processes only
the new tokens, at the right positions, reading and extending the cache (`kvlib.cache`).

RoPE scaling: Llama 3.1's "llama3" frequency scaling (Meta's reference `apply_scaling`) is
implemented, so Llama 3.1 and 3.2 checkpoints load; other schemes (YaRN, dynamic NTK, LongRoPE)
are refused.

What it deliberately does not do: other rope scalings, MoE, quantized weights, training tricks.
Configs that need them are refused with an error rather than loaded wrongly.
Layouts: activations (B, T, d_model); q (B, H, T, D); k, v (B, H_kv, S, D).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from kvlib._validate import check_positive_int
from kvlib.config import attention_geometry, config_dtype, config_field, load_config
from kvlib.errors import UnsupportedConfigError
from kvlib.layers import hybrid
from kvlib.layers.llama import MLP, Attention, RMSNorm, rope_cos_sin
from kvlib.layers.mla import MLAttention
from kvlib.ops.attention import get_backend, reference_attention, visible

# what this model runs (memory sizes more)
LOADABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "deepseek_v2")
LLAMA3_SCALING_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters, named as in Hugging Face's LlamaConfig."""

    vocab_size: int = 128
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int | None = None  # D; None: hidden_size // num_attention_heads (set on creation)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2's q/k/v projections have biases
    sliding_window: int | None = None  # Mistral: attend to the last `sliding_window` positions only
    torch_dtype: str = "float32"
    model_type: str = "llama"
    # Llama 3.1's rope_scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict | None = None
    # Multi-head latent attention (DeepSeek-V2's field names; kvlib.layers.mla): set kv_lora_rank
    # and the three head widths to make every layer MLA. num_key_value_heads then says nothing
    # about the cache (one latent row per token), and head_dim is unused.
    kv_lora_rank: int | None = None  # d_c
    qk_nope_head_dim: int | None = None  # d_h
    qk_rope_head_dim: int | None = None  # d_R
    v_head_dim: int | None = None  # d_v
    # Chapter 17's hybrids (kvlib.layers.hybrid): per layer "full", "sliding" (the window of
    # sliding_window) or "linear" (gated linear attention); None: every layer as sliding_window says
    layer_types: tuple[str, ...] | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates: head_dim, or MLA's decoupled d_R."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        for name in (*sizes, "num_attention_heads", "num_key_value_heads"):
            check_positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "num_key_value_heads: expected a divisor of num_attention_heads "
                f"{self.num_attention_heads}, got {self.num_key_value_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    "hidden_size: expected a multiple of num_attention_heads "
                    f"{self.num_attention_heads} (or an explicit head_dim), got {self.hidden_size}"
                )
            # frozen: the one place D is derived; every reader then uses config.head_dim
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head dimension, got {self.head_dim}")
        mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        given = [name for name in mla if getattr(self, name) is not None]
        if given and len(given) != len(mla):
            raise ValueError(f"kv_lora_rank: MLA needs all of {list(mla)}, got only {given}")
        for name in given:
            check_positive_int(name, getattr(self, name))
        if given and self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim: RoPE needs an even dimension, got {self.qk_rope_head_dim}"
            )
        if self.layer_types is not None:  # a tuple (hashable, like the rest), checked
            object.__setattr__(self, "layer_types", hybrid.check_layer_types(self))

    @classmethod
    def from_hf(cls, config: dict | str | os.PathLike) -> ModelConfig:
        """Read a Hugging Face config (a dict or a path; transformers 4.x or 5.x field names)
        through `kvlib.config`, the reader the memory calculator uses too.

        Raises:
            UnsupportedConfigError: a model type, bias, rope scaling or activation this model
                does not implement, named with the field that asks for it.
        """
        config = load_config(config)
        model_type = config.get("model_type")
        if model_type not in LOADABLE_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"config: model_type {model_type!r} is not supported; supported: "
                f"{', '.join(LOADABLE_MODEL_TYPES)}"
            )
        if config.get("mlp_bias"):
            raise UnsupportedConfigError("config: mlp_bias=true (MLP biases) is not implemented")
        if config.get("attention_bias"):
            raise UnsupportedConfigError(
                "config: attention_bias=true (biases on q/k/v/o) is not implemented"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedConfigError(
                f"config: hidden_act {config['hidden_act']!r} is not implemented (SwiGLU uses silu)"
            )
        rope = config.get("rope_parameters") or {}  # transformers 5.x
        scaling = config.get("rope_scaling") or (
            {k: v for k, v in rope.items() if k != "rope_theta"} if rope else None
        )
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else None
        if rope_type not in (None, "default", "llama3"):
            raise UnsupportedConfigError(
                f"config: rope scaling {scaling!r} is not implemented (default RoPE and Llama "
                "3.1's 'llama3' scaling are)"
            )
        if rope_type == "llama3":
            missing = sorted(set(LLAMA3_SCALING_FIELDS) - set(scaling))
            if missing:
                raise UnsupportedConfigError(
                    f"config: rope_scaling of type 'llama3' lacks {missing}, got {scaling!r}"
                )
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        layer_types = hybrid.layer_types_from_hf(config)  # None: every layer alike
        slides = model_type == "mistral" or config.get("use_sliding_window")
        sliding = (
            config.get("sliding_window") if slides or "sliding" in (layer_types or ()) else None
        )
        if model_type == "qwen2" and config.get("use_sliding_window"):
            raise UnsupportedConfigError(
                "config: Qwen2's use_sliding_window=true (per-layer windows) is not implemented"
            )
        mla = {}
        if model_type == "deepseek_v2":  # dense MLA models (kvlib.layers.mla); not DeepSeek's MoE
            if config.get("q_lora_rank") is not None:
                raise UnsupportedConfigError(
                    "config: q_lora_rank (MLA's query compression) is not implemented"
                )
            layers = config_field(config, "num_hidden_layers")
            if config.get("n_routed_experts") and config.get("first_k_dense_replace", 0) < layers:
                raise UnsupportedConfigError(
                    "config: mixture-of-experts layers (n_routed_experts) are not implemented"
                )
            mla = {
                name: config_field(config, name)
                for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            }
            num_kv_heads = config_field(config, "num_attention_heads")
            head_dim = None
        else:
            num_kv_heads, head_dim, _ = attention_geometry(config, model_type)
        return cls(
            vocab_size=config_field(config, "vocab_size"),
            hidden_size=config_field(config, "hidden_size"),
            intermediate_size=config_field(config, "intermediate_size"),
            num_hidden_layers=config_field(config, "num_hidden_layers"),
            num_attention_heads=config_field(config, "num_attention_heads"),
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            sliding_window=sliding,
            torch_dtype=config_dtype(config) or "float32",
            model_type=model_type,
            rope_scaling=(
                {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_SCALING_FIELDS}}
                if rope_type == "llama3"
                else None
            ),
            layer_types=layer_types,
            **mla,
        )

    def to_hf(self) -> dict:
        """This config as a Hugging Face (transformers 4.x style) config dict."""
        config = {
            k: v for k, v in dataclasses.asdict(self).items() if k != "qkv_bias" and v is not None
        }
        config.update(
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
        )
        if self.is_mla:  # DeepSeek-V2's config with every layer dense, no query compression
            config.update(
                model_type="deepseek_v2",
                architectures=["DeepseekV2ForCausalLM"],
                q_lora_rank=None,
                first_k_dense_replace=self.num_hidden_layers,
            )
        if self.layer_types is not None:  # transformers' names, and the linear layers' geometry
            config.update(hybrid.layer_types_to_hf(self))
        return config


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.layer_types is not None:  # chapter 17: this layer's own kind
            self.self_attn = hybrid.hybrid_attention(config, layer_idx)
        elif config.is_mla:
            self.self_attn = MLAttention(config, layer_idx)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache=None, backend=reference_attention, weights_out=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, backend, weights_out)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def attention_mask_3d(
    num_queries: int,
    num_keys: int,
    padding_mask: torch.Tensor | None,
    sliding_window: int | None,
    device,
) -> torch.Tensor:
    """Boolean (B or 1, T, S) mask in cache-index space: query i (cache index S - T + i) sees key j
    if j <= that index (causal over the cached prefix and within the new tokens), j is not padding
    (a padding query sees only itself), and, with a window, j is among the last `sliding_window`."""
    query_index = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]  # (T, 1)
    key_index = torch.arange(num_keys, device=device)[None, :]  # (1, S)
    mask = visible(key_index, query_index, sliding_window)[None]  # (1, T, S)
    if padding_mask is not None:
        # a padding query would see nothing (a NaN softmax row that leaks into later layers as 0 *
        # NaN);
        # let every query see itself: real queries lose nothing, padding outputs are never used
        mask = (mask & padding_mask[:, None, :].bool()) | (key_index == query_index)[
            None
        ]  # (B, T, S)
    return mask


def restrict_to_tree(
    mask: torch.Tensor, tree_mask: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """`mask` (B or 1, T, S) with its last T columns (the new tokens) narrowed to `tree_mask`
    (T, T) bool: each new token sees the cached tokens, its tree ancestors and itself.

    Raises:
        ValueError: a tree_mask that is not (T, T) bool, or a sliding window (it counts positions
            and a tree's nodes sit at their depths, not their places in the chunk).
    """
    t = mask.shape[-2]
    if sliding_window is not None:
        raise ValueError(
            "tree_mask: a sliding window counts positions, and a tree's nodes sit at their "
            "depths, not their places in the chunk; not supported with sliding_window"
        )
    if tree_mask.shape != (t, t) or tree_mask.dtype != torch.bool:
        raise ValueError(
            f"tree_mask: expected a ({t}, {t}) bool tensor, got {tuple(tree_mask.shape)} "
            f"{tree_mask.dtype}"
        )
    mask = mask.clone()
    mask[..., -t:] &= tree_mask.to(mask.device)  # within the causal rule
    return mask


class LlamaModel(nn.Module):
    """Llama-architecture causal LM: `model(input_ids) -> logits (B, T, V)`."""

    def __init__(self, config: ModelConfig, *, attention_backend: str = "reference"):
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend  # a name in kvlib.ops.ATTENTION_BACKENDS
        get_backend(attention_backend)  # fails early on an unknown name
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if config.layer_types is not None:  # no padding, no draft trees (kvlib.layers.hybrid)
            self.register_forward_pre_hook(hybrid.check_hybrid_inputs, with_kwargs=True)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_weights: list | None = None,
        validate: bool = True,
        logits_indices: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for the T new tokens.

        Args:
            input_ids: (B, T) token ids: the whole sequence, or with a cache the tokens after it.
            cache: a `kvlib.cache.KVCache` holding S0 earlier tokens per sequence (or None).
            attention_mask: (B, S0 + T) 1 for real tokens, 0 for padding (left padding); default all
                1.
            position_ids: (B, T) RoPE positions; default: the cache's `query_positions(T)` if it
                has one (`EvictingCache`), else the count of real tokens before each one.
            attention_weights: a list to receive each layer's (B, H, T, S) attention weights
                (the "reference" backend only).
            validate: check that the ids are in the vocabulary (one host sync: `generate` does it
                once for the prompts and then passes False for every decode step).
            logits_indices: (m,) int64, the positions along T whose logits are wanted (a serving
                engine's rows that sample this step: a prompt's last token, not its other
                tokens); None: all T. The final norm and `lm_head`, a (d_model x V) product per
                row, then run on m rows only (vLLM's `logits_indices`).
            tree_mask: (T, T) bool, which of the new tokens each new token sees (itself and its
                ancestors when the T tokens are a tree of draft candidates: SpecInfer, Miao et
                al., 2024); None: causal. Pass the tree's positions with it: `position_ids` =
                the cached length plus each node's depth.
        Returns:
            (B, T, V) logits in float32; (B, m, V) with `logits_indices`.
        Raises:
            ValueError, TypeError: ids out of range, wrong shapes, a mask of the wrong length.
        """
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.dtype not in (torch.int64, torch.int32)
        ):
            raise TypeError(
                "input_ids: expected an int64 (B, T) tensor, got "
                f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                f"{tuple(getattr(input_ids, 'shape', ()))}"
            )
        b, t = input_ids.shape
        if t == 0 or (
            validate and (input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size)
        ):
            raise ValueError(
                f"input_ids: expected 1+ ids in [0, {self.config.vocab_size}) per row, got shape "
                f"{(b, t)}"
            )
        past = 0 if cache is None else cache.length
        if attention_mask is not None and attention_mask.shape != (b, past + t):
            raise ValueError(
                f"attention_mask: expected shape ({b}, {past + t}) (cached + new tokens), got "
                f"{tuple(attention_mask.shape)}"
            )
        if position_ids is None:
            if hasattr(cache, "query_positions"):  # a cache that decides positions (eviction)
                position_ids = cache.query_positions(t).to(input_ids.device).expand(b, t)
            elif attention_mask is None:
                position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
            else:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[
                    :, past:
                ]  # real tokens before each one
        c = self.config
        cos, sin = rope_cos_sin(position_ids, c.rope_dim, c.rope_theta, c.rope_scaling)
        mask = attention_mask_3d(
            t, past + t, attention_mask, self.config.sliding_window, input_ids.device
        )
        if tree_mask is not None:  # chapter 16: a tree of draft tokens
            mask = restrict_to_tree(mask, tree_mask, c.sliding_window)
        backend = get_backend(self.attention_backend)
        if hasattr(cache, "begin_forward"):  # a cache that stores only real tokens (paged)
            cache.begin_forward(t, attention_mask)
        x = self.model.embed_tokens(input_ids)  # (B, T, d_model)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, cache, backend, attention_weights)
        if cache is not None:
            cache.advance(t)
        if logits_indices is not None:
            x = x.index_select(1, logits_indices)  # (B, m, d_model)
        return self.lm_head(self.model.norm(x)).float()  # (B, T or m, V)
