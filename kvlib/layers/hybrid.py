"""The layers of a hybrid model (chapter 17): each layer of `ModelConfig.layer_types` is "full"
attention, "sliding" window attention, or "linear": gated linear attention, a recurrent layer
whose cache is a fixed-size state (`kvlib.layers.linear_attention`).

- `LinearAttention`: the "linear" layer. Per head, q, k and v are projected as in attention, and a
  decay per token comes from a gate, log_decay = -softplus(x W_g + b_g) <= 0 (Mamba-2's decay
  exp(-softplus(...) · A) with A = 1, one scalar per head and token: Dao & Gu, 2024; GLA's gate
  is a vector, one decay per key channel). Then S_t = a_t S_{t-1} + k_t v_tᵀ, o_t = S_tᵀ q_t,
  computed by `chunked_form` (no cache, or a prefill) or `recurrent_form` (decode).
  Normalisation, for training stability: q and k are L2-normalised per head (Gated DeltaNet's and
  Qwen3-Next's `use_qk_l2norm`; Yang et al., 2024), so |q · k| <= 1 however large the
  projections grow; the output of each head then goes through an RMSNorm (RetNet's and GLA's
  group norm, Mamba-2's output norm), because S_t sums up to 1 / (1 - a) writes and the output
  of an unnormalised head would grow with how long the head remembers. No RoPE, as in GLA,
  Mamba-2 and Qwen3-Next's linear layers (its full-attention layers keep theirs): order enters
  through the decay (the state weights each token by the decays after it) and through the
  attention layers around it. A rotation would fit the state too (RetNet rotates each key by its
  absolute position before it enters the state, in all three of its forms); this layer follows
  the designs that leave order to the decay.
- `GlobalAttention`: a "full" layer in a model whose config has a `sliding_window` for its
  sliding layers: the model's mask is windowed, so this layer attends under the causal mask of
  the same shape instead.
- `check_layer_types`, `layer_types_from_hf`, `layer_types_to_hf`: the config field, checked and
  in transformers' names ("full_attention", "sliding_attention", "linear_attention": Gemma 2/3's
  and Qwen3-Next's `layer_types`), plus the linear layers' geometry in Qwen3-Next's field names
  (`linear_num_key_heads`, ...), which `kvlib.memory` sizes.
- `check_hybrid_inputs`: a model with `layer_types` refuses padding and draft trees (a state
  summed over every earlier token has no way to skip a padding token or a sibling branch).

What it deliberately does not do: the short convolution of Mamba and Qwen3-Next, an output
gate, the delta rule, grouped key/value heads in linear layers (a linear layer has
`num_attention_heads` key and value heads; `num_key_value_heads` applies to attention layers).
Layouts: activations (B, T, d_model); q, k, v (B, H, T, D); log_decay (B, H, T); state
(B, H, D, D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlib.errors import UnsupportedConfigError
from kvlib.layers.linear_attention import chunked_form
from kvlib.layers.llama import Attention, RMSNorm
from kvlib.ops.attention import reference_attention, visible

LAYER_TYPES = ("full", "sliding", "linear")
HF_LAYER_TYPES = {
    "full": "full_attention",
    "sliding": "sliding_attention",
    "linear": "linear_attention",
}
LINEAR_CHUNK_SIZE = 64  # C of `chunked_form` for a forward without a cache (and HybridCache's)
# Initial decay per head: log_decay = -1/4, -1/16, -1/64, -1/256, ... (half-lives of about 3,
# 11, 44 and 177 tokens), RetNet's spread of one fixed decay per head (Sun et al., 2023), here
# the bias of a gate that training then makes depend on the token.
INITIAL_DECAY_BASE = 4.0


class LinearAttention(nn.Module):
    """Gated linear attention (see the module docstring). Parameters: `q_proj`, `k_proj`, `v_proj`
    (d_model -> H · D), `o_proj` (H · D -> d_model), `gate_proj` (d_model -> H, with a bias:
    the decay gate) and `norm` (RMSNorm over D, shared by the heads)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        h, d, heads = config.hidden_size, config.head_dim, config.num_attention_heads
        self.q_proj = nn.Linear(h, heads * d, bias=False)
        self.k_proj = nn.Linear(h, heads * d, bias=False)
        self.v_proj = nn.Linear(h, heads * d, bias=False)
        self.o_proj = nn.Linear(heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, heads, bias=True)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        with torch.no_grad():  # softplus(bias) = INITIAL_DECAY_BASE^-(i + 1) for head i
            rate = INITIAL_DECAY_BASE ** -torch.arange(1.0, heads + 1)  # (H,)
            self.gate_proj.bias.copy_(torch.log(torch.expm1(rate)))  # softplus⁻¹

    def forward(self, x, cos, sin, mask, cache=None, backend=reference_attention, weights_out=None):
        """Attention's signature (`kvlib.layers.llama.Attention`); cos, sin, mask and backend are
        not used (no RoPE, and the recurrence is causal by construction), and nothing is
        appended to `weights_out` (no attention weights). With a cache, the state goes through
        `cache.update_state(layer_idx, q, k, v, log_decay)` (`kvlib.cache.HybridCache`).

        Raises:
            TypeError: a cache without `update_state` (a KV cache has no place for a state).
        """
        b, t, _ = x.shape
        heads, d = self.config.num_attention_heads, self.config.head_dim
        q = self.q_proj(x).view(b, t, heads, d).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, heads, d).transpose(1, 2)  # (B, H, T, D)
        v = self.v_proj(x).view(b, t, heads, d).transpose(1, 2)  # (B, H, T, D)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)  # |q · k| <= 1
        log_decay = -F.softplus(self.gate_proj(x)).transpose(1, 2)  # (B, H, T), <= 0
        if cache is None:
            out, _ = chunked_form(q, k, v, log_decay, LINEAR_CHUNK_SIZE)  # (B, H, T, D)
        else:
            update_state = getattr(cache, "update_state", None)
            if update_state is None:
                raise TypeError(
                    f"cache: layer {self.layer_idx} is linear attention, whose cache is a "
                    "recurrent state; expected a cache with update_state "
                    f"(kvlib.cache.HybridCache), got {type(cache).__name__}"
                )
            out = update_state(self.layer_idx, q, k, v, log_decay)  # (B, H, T, D)
        out = self.norm(out)  # (B, H, T, D): each head's output at unit RMS, times a weight
        return self.o_proj(out.transpose(1, 2).reshape(b, t, heads * d))  # (B, T, d_model)


class GlobalAttention(Attention):
    """A "full" layer of a model whose sliding layers window the model's mask: it attends under
    the causal mask of the mask's shape (B or 1, T, S), query i at cache index S - T + i. Exact
    because a hybrid has no padding and no draft trees (`check_hybrid_inputs`)."""

    def forward(self, x, cos, sin, mask, cache=None, backend=reference_attention, weights_out=None):
        t, s = mask.shape[-2:]
        index = torch.arange(s, device=mask.device)
        causal = visible(index[None, :], index[s - t :, None])[None]  # (1, T, S)
        return super().forward(x, cos, sin, causal, cache, backend, weights_out)


def hybrid_attention(config, layer_idx: int) -> nn.Module:
    """The token-mixing module of layer `layer_idx` of a config with `layer_types`."""
    kind = config.layer_types[layer_idx]
    if kind == "linear":
        return LinearAttention(config, layer_idx)
    if kind == "full" and config.sliding_window is not None:
        return GlobalAttention(config, layer_idx)
    return Attention(config, layer_idx)  # "sliding" (the model's windowed mask), or "full"


def check_layer_types(config) -> tuple[str, ...]:
    """`config.layer_types` as a tuple of `LAYER_TYPES` names, checked against the config.

    Raises:
        ValueError: not one of "full", "sliding", "linear" per layer; "sliding" layers without
            a `sliding_window`, or a `sliding_window` with no "sliding" layer; MLA.
    """
    layer_types = config.layer_types
    if isinstance(layer_types, str) or not hasattr(layer_types, "__len__"):
        raise ValueError(f"layer_types: expected a sequence of {LAYER_TYPES}, got {layer_types!r}")
    layer_types = tuple(layer_types)
    if len(layer_types) != config.num_hidden_layers or any(
        kind not in LAYER_TYPES for kind in layer_types
    ):
        raise ValueError(
            f"layer_types: expected {config.num_hidden_layers} (num_hidden_layers) of "
            f"{LAYER_TYPES}, got {layer_types!r}"
        )
    if ("sliding" in layer_types) != (config.sliding_window is not None):
        raise ValueError(
            "sliding_window: expected a window exactly when layer_types has a 'sliding' layer, "
            f"got sliding_window={config.sliding_window} with layer_types {layer_types!r}"
        )
    if config.is_mla:
        raise ValueError("layer_types: per-layer kinds are not implemented for MLA configs")
    return layer_types


def layer_types_from_hf(config: dict) -> tuple[str, ...] | None:
    """The `layer_types` of a Hugging Face config dict, in `LAYER_TYPES` names, or None where
    every layer is alike (a Qwen2 config lists `full_attention` for every layer): the model type's
    own rules then decide, as before layer types existed.

    Raises:
        UnsupportedConfigError: a kind this model does not implement, named.
    """
    names = config.get("layer_types")
    if not names or (len(set(names)) == 1 and names[0] != HF_LAYER_TYPES["linear"]):
        return None
    ours = {hf: kind for kind, hf in HF_LAYER_TYPES.items()}
    unknown = sorted(set(names) - set(ours))
    if unknown:
        raise UnsupportedConfigError(
            f"config: layer_types {unknown} are not implemented (known: {sorted(ours)})"
        )
    return tuple(ours[name] for name in names)


def layer_types_to_hf(config) -> dict:
    """The config fields that describe `config.layer_types` to Hugging Face readers and to
    `kvlib.memory`: `layer_types` in transformers' names and, with a linear layer, its state's
    geometry in Qwen3-Next's names (H key and value heads of D; no convolution, so no
    `linear_conv_kernel_dim`)."""
    fields = {"layer_types": [HF_LAYER_TYPES[kind] for kind in config.layer_types]}
    if "linear" in config.layer_types:
        heads, d = config.num_attention_heads, config.head_dim
        fields.update(
            linear_num_key_heads=heads,
            linear_num_value_heads=heads,
            linear_key_head_dim=d,
            linear_value_head_dim=d,
        )
    return fields


def check_hybrid_inputs(model, args, kwargs) -> None:
    """A forward pre-hook (`LlamaModel` registers it for a config with `layer_types`): refuse
    padding and draft trees, which a recurrent layer cannot skip.

    Raises:
        ValueError: an `attention_mask` with a 0, or a `tree_mask`.
    """
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "attention_mask: a hybrid model (layer_types) does not support padding: its linear "
            "layers' state sums over every earlier token; pass unpadded sequences of one length"
        )
    if kwargs.get("tree_mask") is not None:
        raise ValueError(
            "tree_mask: a hybrid model (layer_types) cannot verify a tree of drafts: a recurrent "
            "state holds one sequence of tokens, not branches"
        )
