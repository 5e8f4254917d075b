"""Ship the K/V or recompute it? (chapter 14): bytes against FLOPs, and the break-even bandwidth.

A decode engine that receives a request's prompt K/V from a prefill engine (disaggregated
serving: DistServe, Splitwise, Mooncake) saves the prefill's FLOPs and pays for the bytes. The
bytes are chapter 3's equation, `kv_bytes_per_token · n` (`kvlib.memory.kv_bytes_per_token`);
the FLOPs of a causal prefill of n tokens, for a dense Llama-family model (multiply-add = 2 FLOPs):

    linear:    2 · n · L · (d·H·D + 2·d·H_kv·D + H·D·d + 3·d·I)   (q, k, v, o; SwiGLU's 3 matrices)
    attention: 2 · L · H · D · n · (n + 1)                        (QKᵀ and AV over n(n+1)/2 pairs)

leaving out the embedding lookup and the LM head (the request computes the last token's logits
either way). The linear term is the "2 · params · n" rule of thumb with params counting only the
layers' linear weights (`linear_weight_count`; chapter 14 prints it for SmolLM2 and Llama 3 8B,
whose embeddings it leaves out). Recomputing takes FLOPs / (the accelerator's achieved
FLOP/s); shipping takes bytes / bandwidth; they take equally long at the **break-even
bandwidth** bytes · (FLOP/s) / FLOPs, which is proportional to the FLOP/s assumed. Over a faster
link, shipping wins. Deliberately left out: the transfer's latency, overlap of transfer with
compute (layer-wise pipelining), and the decode side's own work.
"""

from __future__ import annotations

from kvlib._validate import check_positive_int
from kvlib.config import config_field, load_config
from kvlib.memory import kv_bytes_per_token

__all__ = ["break_even_bandwidth", "kv_transfer_bytes", "linear_weight_count", "prefill_flops"]


def _attention_shape(c: dict) -> tuple[int, int, int, int]:
    """(L, d, H, D) of a loaded config."""
    d, num_heads = config_field(c, "hidden_size"), config_field(c, "num_attention_heads")
    return config_field(c, "num_hidden_layers"), d, num_heads, c.get("head_dim") or d // num_heads


def linear_weight_count(config) -> int:
    """Weights of every layer's linear projections (q, k, v, o and SwiGLU's three matrices) of a
    dense Llama-family model: the `params` of "2 · params · n", without the embedding, the LM head
    and the norms."""
    c = load_config(config)
    num_layers, d, num_heads, head_dim = _attention_shape(c)
    num_kv_heads = c.get("num_key_value_heads") or num_heads
    per_layer = d * num_heads * head_dim + 2 * d * num_kv_heads * head_dim
    per_layer += num_heads * head_dim * d + 3 * d * config_field(c, "intermediate_size")
    return num_layers * per_layer


def prefill_flops(config, num_tokens: int) -> int:
    """FLOPs of a causal prefill of `num_tokens` tokens through every layer of a dense
    Llama-family model (a Hugging Face config dict or path; see the module docstring)."""
    c = load_config(config)
    n = check_positive_int("num_tokens", num_tokens)
    num_layers, _, num_heads, head_dim = _attention_shape(c)
    linear = 2 * n * linear_weight_count(c)
    attention = 2 * num_layers * num_heads * head_dim * n * (n + 1)
    return linear + attention


def kv_transfer_bytes(config, num_tokens: int, cache_dtype: str | None = None) -> int:
    """Bytes of `num_tokens` tokens' K/V, every layer (chapter 3: `kv_bytes_per_token` · n)."""
    return kv_bytes_per_token(config, cache_dtype) * check_positive_int("num_tokens", num_tokens)


def break_even_bandwidth(
    config, num_tokens: int, flops_per_s: float, cache_dtype: str | None = None
) -> float:
    """Bytes per second at which shipping `num_tokens` tokens' K/V takes as long as recomputing
    them at `flops_per_s` achieved FLOP/s: bytes · flops_per_s / FLOPs."""
    if not flops_per_s > 0:
        raise ValueError(f"flops_per_s: expected a number > 0, got {flops_per_s!r}")
    return (
        kv_transfer_bytes(config, num_tokens, cache_dtype)
        * flops_per_s
        / prefill_flops(config, num_tokens)
    )
