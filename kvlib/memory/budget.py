"""What fits on a GPU: the whole-VRAM budget (weights, runtime overhead, prefill activations, and
what is left for the KV cache) and how many sequences it holds (chapter 3).
"""

from __future__ import annotations

import dataclasses
import math

from kvlib._validate import check_positive_int
from kvlib.config import DTYPE_BITS, config_dtype, config_field, load_config, normalize_dtype
from kvlib.errors import UnsupportedConfigError
from kvlib.memory.equation import format_bytes, kv_cache_bytes, quantized_kv_cache_bytes


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
    hidden = config_field(config, "hidden_size", "n_embd", "d_model")
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
    kv_schemes: tuple | None = None,
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
        kv_schemes: (key_scheme, value_scheme) of a quantized cache (`kvlib.quant.QuantScheme`):
            sequences are sized by `quantized_kv_cache_bytes`, scales and zero points included
            (`cache_dtype` is then unused).
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
    if kv_schemes is None:
        per_sequence = kv_cache_bytes(config, seq_len, 1, cache_dtype)
    else:
        per_sequence = quantized_kv_cache_bytes(config, seq_len, *kv_schemes)
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
