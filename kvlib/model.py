"""A decoder-only transformer with the Llama architecture, and a loader for Hugging Face
Llama-format checkpoints.

What it does: RMSNorm (Zhang & Sennrich, 2019), rotary position embeddings in the Hugging Face
`rotate_half` convention (Su et al., 2021), SwiGLU MLP (Shazeer, 2020), no biases except the q/k/v
biases of Qwen2, MHA/GQA/MQA from one code path (`num_key_value_heads`), an optional sliding window
(Mistral). Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`), so a
checkpoint's state dict loads as is. `model(input_ids, cache=...)` processes only the new tokens,
at the right positions, reading and extending the cache (`kvlib.cache`).

RoPE scaling: Llama 3.1's "llama3" frequency scaling (Meta's reference `apply_scaling`) is
implemented, so Llama 3.1 and 3.2 checkpoints load; other schemes (YaRN, dynamic NTK, LongRoPE)
are refused.

What it deliberately does not do: other rope scalings, MoE, quantized weights, training tricks.
Configs that need them are refused with an error rather than loaded wrongly.
Layouts: activations (B, T, d_model); q (B, H, T, D); k, v (B, H_kv, S, D).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvlib._validate import check_positive_int
from kvlib.config import attention_geometry, config_dtype, config_field, load_config
from kvlib.errors import UnsupportedConfigError
from kvlib.ops.attention import get_backend, reference_attention

LOADABLE_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "deepseek_v2",
)  # what this model runs (memory sizes more)
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
    # Multi-head latent attention (DeepSeek-V2's field names; kvlib.mla): set kv_lora_rank and the
    # three head widths to make every layer MLA. num_key_value_heads then says nothing about the
    # cache (one latent row per token), and head_dim is unused.
    kv_lora_rank: int | None = None  # d_c
    qk_nope_head_dim: int | None = None  # d_h
    qk_rope_head_dim: int | None = None  # d_R
    v_head_dim: int | None = None  # d_v

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates: head_dim, or MLA's decoupled d_R."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        ):
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
        sliding = (
            config.get("sliding_window")
            if model_type == "mistral" or config.get("use_sliding_window")
            else None
        )
        if model_type == "qwen2" and config.get("use_sliding_window"):
            raise UnsupportedConfigError(
                "config: Qwen2's use_sliding_window=true (per-layer windows) is not implemented"
            )
        mla = {}
        if model_type == "deepseek_v2":  # dense MLA models (kvlib.mla); not DeepSeek's MoE
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
        return config


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in float32 (Zhang & Sennrich, 2019)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict | None = None, device=None
) -> torch.Tensor:
    """RoPE's angular frequencies theta^(-2i/D), i < D/2: (D/2,) float32, radians per position.

    With Llama 3.1's scaling (`scaling["rope_type"] == "llama3"`; Meta's reference
    `apply_scaling`, Grattafiori et al., 2024), frequencies whose wavelength `2π/f` is shorter than
    `original_max_position_embeddings / high_freq_factor` are kept, those longer than
    `original_max_position_embeddings / low_freq_factor` are divided by `factor`, and those in
    between are interpolated linearly in `original_max_position_embeddings / wavelength`.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = theta**-exponents  # (D/2,)
    if scaling is None:
        return inv_freq
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq  # (D/2,) positions per turn
    smooth = ((old_context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long, 1: short
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for rotary embeddings at integer `positions` (B, T): each (B, T, D).

    Frequencies from `rope_inverse_frequencies` (theta^(-2i/D), optionally Llama 3.1-scaled), each
    used twice ([f, f] concatenated): the Hugging Face convention that pairs dimension i with
    i + D/2 (see `rotate_half`).
    """
    inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, positions.device)  # (D/2,)
    angles = positions.float()[..., None] * inv_freq  # (B, T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, D)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the angles of cos, sin (B, T, D): x·cos + rotate_half(x)·sin."""
    return (x.float() * cos[:, None] + rotate_half(x.float()) * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)

    def forward(self, x, cos, sin, mask, cache=None, backend=reference_attention, weights_out=None):
        b, t, _ = x.shape
        c = self.config
        q = (
            self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        )  # (B, H, T, D)
        # (B, H_kv, T, D)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        # (B, H_kv, T, D)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        if not getattr(cache, "rotates_keys", False):  # a cache that rotates on read gets raw keys
            k = apply_rope(k, cos, sin)  # keys are cached already rotated
        # the seam: the cache stores K/V and says what attention reads; a backend attends over it
        kv = (k, v) if cache is None else cache.update(self.layer_idx, k, v)
        attend = getattr(cache, "attention_backend", None) or backend
        out = attend(q, kv, mask, weights_out=weights_out)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, c.num_attention_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_mla:
            from kvlib.mla import MLAttention

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
    mask = key_index <= query_index  # (T, S)
    if sliding_window is not None:
        mask &= key_index > query_index - sliding_window
    mask = mask[None]  # (1, T, S)
    if padding_mask is not None:
        # a padding query would see nothing (a NaN softmax row that leaks into later layers as 0 *
        # NaN);
        # let every query see itself: real queries lose nothing, padding outputs are never used
        mask = (mask & padding_mask[:, None, :].bool()) | (key_index == query_index)[
            None
        ]  # (B, T, S)
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
        Returns:
            (B, T, V) logits in float32.
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
        backend = get_backend(self.attention_backend)
        if hasattr(cache, "begin_forward"):  # a cache that stores only real tokens (paged)
            cache.begin_forward(t, attention_mask)
        x = self.model.embed_tokens(input_ids)  # (B, T, d_model)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, cache, backend, attention_weights)
        if cache is not None:
            cache.advance(t)
        return self.lm_head(self.model.norm(x)).float()  # (B, T, V)


# --- Hugging Face checkpoints ---------------------------------------------------------------------


def save_hf_checkpoint(model: LlamaModel, path: str | os.PathLike) -> None:
    """Write `config.json` and `model.safetensors` in the Hugging Face Llama layout."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_hf_checkpoint(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LlamaModel:
    """Load a local Hugging Face Llama-format checkpoint (config.json + *.safetensors) by parameter
    name.

    Args:
        path: the checkpoint directory.
        dtype: load the weights in this dtype (default: the config's `torch_dtype`/`dtype`).
    Raises:
        FileNotFoundError: no config.json or no safetensors files.
        UnsupportedConfigError: see `ModelConfig.from_hf`.
        ValueError: missing or unexpected parameters, or shapes that disagree with the config.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"path: no config.json in {path}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"path: no *.safetensors files in {path}")
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    if dtype is None:  # the config's dtype name (normalised by kvlib.config) as a torch dtype
        dtype = getattr(torch, config.torch_dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise UnsupportedConfigError(
                f"config: weights in {config.torch_dtype!r} are not supported; pass dtype="
            )
    state = {}
    for file in files:
        state.update(load_file(str(file), device=str(device)))
    return model_from_state_dict(config, state, dtype=dtype, device=device, source=str(path))


def model_from_state_dict(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    source: str = "state dict",
) -> LlamaModel:
    """A `LlamaModel` holding `state` (Hugging Face parameter names), in `dtype`, in eval mode.

    Raises:
        ValueError: missing or unexpected parameters, or shapes that disagree with the config (the
            message names `source`).
    """
    path = source
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state.pop("lm_head.weight", None)
    state = {
        k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")
    }  # buffers some exports include
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path}: missing parameters {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"checkpoint {path}: {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()
