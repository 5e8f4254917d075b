"""Chapter 3's graded questions: bytes per token for GQA with an explicit head_dim, the MLA cache,
and the largest batch a GPU holds. Oracle: kvlib.memory."""

from __future__ import annotations

from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Submission, expect_int, question
from kvlib.memory import kv_bytes_per_token, kv_cache_bytes

GQA_CONFIGS = [
    {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "torch_dtype": "bfloat16",
    },
    {
        "model_type": "gemma3_text",
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "hidden_size": 5376,
        "torch_dtype": "bfloat16",
    },
    {
        "model_type": "qwen2",
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
        "torch_dtype": "float32",
    },
    {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "hidden_size": 64,
        "torch_dtype": "float16",
    },
]


@question(function="gqa_bytes_per_token")
def test_gqa_bytes_per_token(submission: Submission) -> None:
    gqa_bytes_per_token = submission.function("gqa_bytes_per_token")
    drawn, configs = submission.rng(), submission.fixed(GQA_CONFIGS)
    for _ in range(3):  # drawn afresh on every run
        heads = int(drawn.choice([4, 8, 12, 16, 32, 64]))
        divisors = [h for h in range(1, heads + 1) if heads % h == 0]
        config = {
            "model_type": "llama",
            "num_hidden_layers": int(drawn.integers(1, 100)),
            "num_attention_heads": heads,
            "num_key_value_heads": int(drawn.choice(divisors)),
            "hidden_size": heads * int(drawn.choice([32, 64, 128])),
            "torch_dtype": str(drawn.choice(["bfloat16", "float16", "float32"])),
        }
        if drawn.random() < 0.5:  # a head_dim that is not hidden_size / num_attention_heads
            config["head_dim"] = int(drawn.choice([64, 96, 128, 256]))
        configs.append(config)
    for config in configs:
        # the oracle treats every layer as full attention, as the question says (no windows)
        expected = kv_bytes_per_token(dict(config, model_type="llama"))
        got = gqa_bytes_per_token(dict(config))
        expect_int(got, "gqa_bytes_per_token")
        fields = ", ".join(f"{k}={v}" for k, v in config.items() if k != "model_type")
        with naming_mistakes(got, _gqa_mistakes(config, expected)):
            assert got == expected, (
                f"for {fields}: expected {expected:,} bytes per token, got {got!r}"
            )


def _gqa_mistakes(config: dict, expected: int) -> dict:
    """gqa_bytes_per_token's common mistakes for `config`, and what each returns."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads, element_bytes = config["num_key_value_heads"], expected // (2 * layers)
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    element_bytes //= kv_heads * head_dim
    return {
        "num_attention_heads K/V heads: with GQA only num_key_value_heads are cached": lambda: (
            2 * layers * heads * head_dim * element_bytes
        ),
        "head_dim taken as hidden_size / num_attention_heads: use the config's head_dim when it "
        "has one": lambda: 2 * layers * kv_heads * (config["hidden_size"] // heads) * element_bytes,
        "K only: V is cached too (a factor 2)": lambda: expected // 2,
        "one layer: every layer caches its own K and V (a factor num_hidden_layers)": lambda: (
            expected // layers
        ),
        "bits, not bytes": lambda: expected * 8,
        "elements, not bytes (multiply by the dtype's bytes per element)": lambda: (
            expected // element_bytes
        ),
    }


@question(function="mla_cache_bytes")
def test_mla_cache_bytes(submission: Submission) -> None:
    mla_cache_bytes = submission.function("mla_cache_bytes")
    drawn = submission.rng()
    cases = submission.fixed(
        [(61, 512, 64, 1, 2), (61, 512, 64, 4096, 2), (27, 512, 64, 1000, 1), (2, 16, 4, 7, 4)]
    )
    cases += [  # drawn afresh on every run
        (
            *(int(n) for n in drawn.integers(1, (100, 1024, 128, 10**6))),
            int(drawn.choice([1, 2, 4])),
        )
        for _ in range(3)
    ]
    for layers, rank, rope, seq_len, bytes_per_element in cases:
        config = {
            "model_type": "deepseek_v3",
            "num_hidden_layers": layers,
            "kv_lora_rank": rank,
            "qk_rope_head_dim": rope,
        }
        dtype = {1: "int8", 2: "bfloat16", 4: "float32"}[bytes_per_element]
        expected = kv_cache_bytes(config, seq_len, cache_dtype=dtype)
        got = mla_cache_bytes(layers, rank, rope, seq_len, bytes_per_element)
        expect_int(got, "mla_cache_bytes")
        per_value = seq_len * bytes_per_element
        mistakes = {
            "the latent only: the shared rotary key (qk_rope_head_dim) is cached too": lambda: (
                layers * rank * per_value
            ),
            "one layer: the latent is cached per layer (a factor num_layers)": lambda: (
                (rank + rope) * per_value
            ),
            "twice the latent, as if K and V were cached apart: MLA caches one latent": lambda: (
                2 * layers * (rank + rope) * per_value
            ),
            "bits, not bytes": lambda: expected * 8,
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"num_layers={layers}, kv_lora_rank={rank}, qk_rope_head_dim={rope}, "
                f"seq_len={seq_len}, "
                f"bytes_per_element={bytes_per_element}: expected {expected:,} bytes, got {got!r}"
            )


@question(function="max_batch")
def test_max_batch(submission: Submission) -> None:
    max_batch = submission.function("max_batch")
    cases = submission.fixed([  # gpu, weights, overhead, kv bytes per token, seq_len
        (80 * 10**9, 16 * 10**9, 4 * 10**9, 131072, 8192),
        (80 * 10**9, 16 * 10**9, 4 * 10**9, 131072, 131072),
        (24 * 10**9, 14 * 10**9, 2 * 10**9, 524288, 4096),
        (141 * 10**9, 140 * 10**9, 2 * 10**9, 1024, 10),
        (10**9 + 3 * 4096 * 100, 10**9, 0, 4096, 100),  # exactly 3 sequences: a budget met fits
    ])  # fmt: skip
    drawn = submission.rng()
    for _ in range(3):  # drawn afresh on every run
        per_token, seq_len = int(drawn.integers(1, 10**6)), int(drawn.integers(1, 10**5))
        weights, overhead = (int(n) for n in drawn.integers(0, 10**11, size=2))
        gpu = weights + overhead + int(drawn.integers(-(10**10), 10**11))
        if drawn.random() < 0.5:  # on the boundary: free memory a whole number of sequences
            gpu = weights + overhead + int(drawn.integers(0, 50)) * per_token * seq_len
        cases.append((gpu, weights, overhead, per_token, seq_len))
    for gpu, weights, overhead, per_token, seq_len in cases:
        expected = max(0, (gpu - weights - overhead) // (per_token * seq_len))
        got = max_batch(gpu, weights, overhead, per_token, seq_len)
        expect_int(got, "max_batch")
        free, per_sequence = gpu - weights - overhead, per_token * seq_len
        mistakes = {
            "the overhead not subtracted": lambda: max(0, (gpu - weights) // per_sequence),
            "rounded up: a sequence that does not fit whole does not fit": lambda: max(
                0, -(-free // per_sequence)
            ),
            "not clamped at 0 (no memory left means no sequence)": lambda: free // per_sequence,
            "one token per sequence (multiply by seq_len)": lambda: max(0, free // per_token),
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"a {gpu / 1e9:g} GB GPU, {weights / 1e9:g} GB of weights, {overhead / 1e9:g} GB "
                "overhead, "
                f"{per_token:,} B/token, {seq_len} tokens per sequence: expected {expected} "
                f"sequences, got {got}"
            )


LLAMA_2_7B = {  # meta-llama/Llama-2-7b-hf's config.json, the fields the cache depends on
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_size": 4096,
    "torch_dtype": "float16",
}


@question(function="predict_llama2_bytes_per_token")
def test_predict_llama2_bytes_per_token(submission: Submission) -> None:
    """A prediction question: Llama-2-7B's cache bytes per token in float16, a constant."""
    predict = submission.function("predict_llama2_bytes_per_token")
    expected = kv_bytes_per_token(LLAMA_2_7B)
    got = predict()
    expect_int(got, "predict_llama2_bytes_per_token")
    with naming_mistakes(got, _gqa_mistakes(LLAMA_2_7B, expected) | {
        "KiB, not bytes": lambda: expected // 1024,
    }):  # fmt: skip
        assert got == expected, (
            f"Llama-2-7B (32 layers, 32 heads of 128, no GQA, float16): you predicted {got!r} "
            "bytes per token; count K and V, every layer, every head, 2 bytes a value"
        )
