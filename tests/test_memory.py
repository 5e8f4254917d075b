"""kvlib.memory: published figures, bytes of real allocations, and clear errors on bad configs."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvlib import memory as M
from kvlib.errors import UnsupportedConfigError
from kvlib.ref.toy_generation import generate_cached
from kvlib.ref.toy_model import ToyConfig, ToyModel

CONFIGS = M.shipped_configs()
GiB, KiB = 2**30, 2**10


def test_ships_at_least_twelve_configs_spanning_the_families():
    assert len(CONFIGS) >= 12
    kinds = {spec.kind for config in CONFIGS.values() for spec in M.layer_specs(config)}
    assert {"full", "sliding", "mla", "mamba"} <= kinds
    families = {
        M.layer_specs(c)[0].description.split(":")[0]
        for c in CONFIGS.values()
        if M.layer_specs(c)[0].elements_per_token
    }
    assert {"MHA", "GQA", "MQA", "MLA latent"} <= families


# Published numbers (quoted in the chapter, with citations).
def test_opt_13b_is_800_kib_per_token_as_in_the_pagedattention_paper():
    assert M.kv_bytes_per_token(CONFIGS["opt-13b"]) == 800 * KiB  # Kwon et al. 2023: "800 KB"
    # "as much as 1.6 GB" at 2048 tokens
    assert M.kv_cache_bytes(CONFIGS["opt-13b"], 2048) == 1600 * 2**20


def test_jamba_paper_table_1_kv_cache_at_256k():
    # Lieber et al. 2024, Table 1 (256K tokens, 16-bit): Llama-2 7B 128GB, Mistral 7B 32GB, Jamba
    # 4GB.
    assert M.kv_cache_bytes(CONFIGS["llama-2-7b"], 262144) == 128 * GiB
    # the table ignores the window
    assert M.kv_bytes_per_token(CONFIGS["mistral-7b-v0.1"]) * 262144 == 32 * GiB
    jamba = M.kv_cache_bytes(CONFIGS["jamba-v0.1"], 262144)
    assert 4 * GiB < jamba < 4.01 * GiB  # 4 GiB of KV plus 8.75 MiB of Mamba state


def test_mistral_window_saves_8x_at_32k_as_in_the_mistral_paper():
    config = CONFIGS["mistral-7b-v0.1"]
    # Jiang et al. 2023: "8x"
    assert M.kv_bytes_per_token(config) * 32768 == 8 * M.kv_cache_bytes(config, 32768)


def test_deepseek_v3_mla_is_576_elements_per_layer():
    config = CONFIGS["deepseek-v3"]
    assert M.kv_bytes_per_token(config) == 61 * (512 + 64) * 2 == 70272
    naive = (
        2
        * 61
        * config["num_key_value_heads"]
        * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
        * 2
    )
    assert naive / M.kv_bytes_per_token(config) > 50  # what an estimator ignoring MLA would claim


# Figures inference engines reported (quoted in the chapter with links).
MiB = 2**20


def test_llama_3_8b_matches_llama_cpp_and_vllm_allocations():
    config = CONFIGS["llama-3-8b"]
    # llama.cpp at n_ctx 2048
    assert M.kv_cache_bytes(config, 2048, cache_dtype="float16") == 256 * MiB
    # vLLM (vllm#12330): 11.12 GiB reserved, 5691 blocks of 16 tokens; the GiB figure is rounded.
    assert M.kv_cache_bytes(config, 5691 * 16) / GiB == pytest.approx(11.12, abs=0.005)


def test_qwen2_5_7b_matches_vllm_cpu_block_count():
    # vllm#13882 (Qwen2.5-7B-Instruct, bnb-4bit weights, bfloat16 cache): "# CPU blocks: 4681". vLLM
    # V0
    # sizes that pool as swap_space (default 4 GiB) // block bytes, a block holding 16 tokens.
    def cpu_blocks(config):
        return 4 * GiB // (16 * M.kv_bytes_per_token(config, "bfloat16"))

    config = CONFIGS["qwen2.5-7b"]
    assert cpu_blocks(config) == 4681
    # what MHA (7x the cache) would have logged
    assert cpu_blocks(dict(config, num_key_value_heads=config["num_attention_heads"])) == 668


def f16_bytes_per_cell(config, kind):
    """Bytes one f16 cache cell (one token) takes across every layer of one kind, with no window
    cap."""
    return 2 * sum(s.elements_per_token for s in M.layer_specs(config) if s.kind == kind)


def test_gpt_oss_20b_matches_llama_cpp_full_and_sliding_caches():
    # ik_llama.cpp#822, a llama-server log at -c 131072 (f16): 12 full layers x 131,072 cells = 3072
    # MiB,
    # 12 sliding layers x 768 cells (128-token window + 512 micro-batch, padded to 256) = 18 MiB.
    config = CONFIGS["gpt-oss-20b"]
    assert f16_bytes_per_cell(config, "full") * 131072 == 3072 * MiB
    assert f16_bytes_per_cell(config, "sliding") * 768 == 18 * MiB
    # kvlib sizes what the model attends to: the sliding layers keep 128 tokens, not llama.cpp's 768
    # cells.
    assert (
        M.kv_cache_bytes(config, 131072, cache_dtype="float16")
        == 3072 * MiB + 18 * MiB * 128 // 768
    )


def test_deepseek_v3_matches_llama_cpp_mla_cache():
    # llama.cpp#11446, 61 layers at 32,768 tokens: "KV self size = 2196.00 MiB, K^R (f16): 244.00
    # MiB, c^KV (f16): 1952.00 MiB".
    config = CONFIGS["deepseek-v3"]
    assert M.kv_cache_bytes(config, 32768, cache_dtype="float16") == 2196 * MiB
    layers = config["num_hidden_layers"]
    assert layers * config["kv_lora_rank"] * 32768 * 2 == 1952 * MiB
    assert layers * config["qk_rope_head_dim"] * 32768 * 2 == 244 * MiB


def test_gpt2_matches_the_ggml_gpt2_example_readme():
    # "memory size = 72.00 MB, n_mem = 12288": K and V in f32 for 12 layers x 1,024 positions, MB =
    # 1024**2 bytes.
    assert M.kv_cache_bytes(CONFIGS["gpt2"], 1024, cache_dtype="float32") == 72 * MiB


def test_falcon_launch_blog_table_confirms_multiquery_to_its_rounding():
    # huggingface.co/blog/falcon, "K,V-cache size for a 2.048 context": Falcon-7B 20MB, Falcon-40B
    # 240MB.
    falcon_7b = CONFIGS["falcon-7b"]
    # 16.8 MB: "20MB" to one significant figure
    assert M.kv_cache_bytes(falcon_7b, 2048) == 16 * MiB
    # MHA would be ~1,191 MB
    assert M.kv_cache_bytes(dict(falcon_7b, multi_query=False), 2048) == 71 * 16 * MiB
    falcon_40b = {
        "model_type": "falcon",
        "num_hidden_layers": 60,
        "num_attention_heads": 128,
        "num_kv_heads": 8,
        "hidden_size": 8192,
        "new_decoder_architecture": True,
        "torch_dtype": "bfloat16",
    }
    assert M.kv_cache_bytes(falcon_40b, 2048) == 240 * MiB


def test_mamba_state_matches_llama_cpp_after_its_conv_convention():
    config = CONFIGS["mamba-2.8b"]
    one_conv_column = 64 * 5120 * 4  # llama.cpp keeps d_conv - 1 columns, HF's MambaCache d_conv
    assert M.kv_cache_bytes(config, 1, cache_dtype="float32") - one_conv_column == 23.75 * MiB


def test_gpt_oss_alternating_layers_halve_the_cache_at_long_context():
    config = CONFIGS["gpt-oss-20b"]
    ratio = M.kv_cache_bytes(config, 131072) / (M.kv_bytes_per_token(config) * 131072)
    # "halved" (Hugging Face transformers blog on gpt-oss)
    assert ratio == pytest.approx(0.5, abs=0.001)


def test_ssm_state_is_constant_and_per_token_growth_is_zero():
    config = CONFIGS["mamba-2.8b"]
    assert M.kv_bytes_per_token(config, "bfloat16") == 0
    state = 64 * 5120 * (4 + 16) * 2
    assert (
        M.kv_cache_bytes(config, 1, cache_dtype="bfloat16")
        == M.kv_cache_bytes(config, 10**6, cache_dtype="bfloat16")
        == state
    )


def test_gemma3_text_config_and_pattern():
    specs = M.layer_specs(CONFIGS["gemma-3-27b"])  # read from text_config
    assert [s.index for s in specs if s.kind == "full"] == list(range(5, 62, 6))
    assert all(s.token_cap == 1024 for s in specs if s.kind == "sliding")
    # explicit head_dim, not 5376 / 32
    assert M.kv_bytes_per_token(CONFIGS["gemma-3-27b"]) == 62 * 2 * 16 * 128 * 2


def test_qwen_sliding_window_disabled_and_gpt_oss_layer_types():
    assert all(s.kind == "full" for s in M.layer_specs(CONFIGS["qwen2.5-7b"]))
    enabled = dict(
        CONFIGS["qwen2.5-7b"], use_sliding_window=True, sliding_window=4096, max_window_layers=20
    )
    assert [s.kind for s in M.layer_specs(enabled)] == ["full"] * 20 + ["sliding"] * 8
    kinds = [s.kind for s in M.layer_specs(CONFIGS["gpt-oss-20b"])]
    assert kinds == ["sliding", "full"] * 12


def test_dtypes_and_aliases():
    config = CONFIGS["llama-3-8b"]
    bf16 = M.kv_cache_bytes(config, 1000)
    assert (
        M.kv_cache_bytes(config, 1000, cache_dtype="fp8") * 2
        == bf16
        == M.kv_cache_bytes(config, 1000, cache_dtype="int4") * 4
    )
    assert M.kv_cache_bytes(config, 1000, cache_dtype="torch.float32") == 2 * bf16
    # transformers 5.x field
    assert M.kv_cache_bytes(dict(config, torch_dtype=None, dtype="bfloat16"), 1000) == bf16
    assert M.kv_cache_bytes(config, 1000, batch_size=3) == 3 * bf16


def test_streaming_llm_sinks_cap_every_attention_layer():
    config = CONFIGS["llama-3-8b"]
    capped = M.kv_cache_bytes(config, 100_000, sink_tokens=4, sink_window=1020)
    assert capped == M.kv_cache_bytes(config, 1024)
    with pytest.raises(ValueError, match="sink_window"):
        M.kv_cache_bytes(config, 10, sink_tokens=4)


# Bytes of caches really allocated equal the formula exactly.
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}

SMALL_CONFIGS = {
    "gqa": {
        "model_type": "llama",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 32,
        "torch_dtype": "float16",
    },
    "gemma2": {
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "hidden_size": 24,
        "sliding_window": 5,
        "torch_dtype": "bfloat16",
    },
    "mla": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 2,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "torch_dtype": "bfloat16",
    },
    "mamba": {
        "model_type": "mamba",
        "num_hidden_layers": 2,
        "hidden_size": 8,
        "intermediate_size": 16,
        "state_size": 4,
        "conv_kernel": 3,
        "expand": 2,
        "torch_dtype": "float32",
    },
    "jamba": {
        "model_type": "jamba",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 16,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "mamba_d_state": 4,
        "mamba_d_conv": 2,
        "mamba_expand": 2,
        "torch_dtype": "float16",
    },
}


def allocate_cache(config, batch_size, seq_len, dtype):
    """Allocate the tensors a cache for this config holds, shaped as the models' caches are."""
    config = M.load_config(config)
    tensors = []
    for spec in M.layer_specs(config):
        held = spec.tokens_held(seq_len)
        if spec.kind == "mla":  # one latent per token: (B, S, kv_lora_rank + qk_rope_head_dim)
            tensors.append(torch.empty(batch_size, held, spec.elements_per_token, dtype=dtype))
        elif spec.kind in ("mamba",):  # conv (B, intermediate, K) and ssm (B, intermediate, N)
            inner = (
                config.get("intermediate_size") or config["mamba_expand"] * config["hidden_size"]
            )
            kernel, state = (
                config.get("conv_kernel", config.get("mamba_d_conv")),
                config.get("state_size", config.get("mamba_d_state")),
            )
            tensors += [
                torch.empty(batch_size, inner, kernel, dtype=dtype),
                torch.empty(batch_size, inner, state, dtype=dtype),
            ]
        else:  # K and V: (B, H_kv, S, D) each
            kv_heads = config.get("num_key_value_heads", config.get("num_attention_heads"))
            head_dim = spec.elements_per_token // (2 * kv_heads)
            tensors += [
                torch.empty(batch_size, kv_heads, held, head_dim, dtype=dtype) for _ in range(2)
            ]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", SMALL_CONFIGS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("seq_len", [1, 4, 9])
def test_formula_equals_allocated_bytes(name, dtype, seq_len):
    config = SMALL_CONFIGS[name]
    allocated = allocate_cache(config, 3, seq_len, TORCH_DTYPES[dtype])
    assert M.kv_cache_bytes(dict(config, torch_dtype=dtype), seq_len, batch_size=3) == allocated


def test_formula_equals_chapter_1_cache():
    model = ToyModel(ToyConfig(num_layers=3, head_dim=8, d_model=16))
    cache = model.new_cache(40)
    generate_cached(model, np.arange(7), 20, cache=cache)
    config = {
        "model_type": "llama",
        "num_hidden_layers": 3,
        "num_attention_heads": 1,
        "head_dim": 8,
        "hidden_size": 16,
        "torch_dtype": "float64",
    }
    assert M.kv_cache_bytes(config, cache.length) == cache.buffer[:, :, : cache.length].nbytes


def test_int4_packs_two_per_byte():
    config = dict(SMALL_CONFIGS["gqa"], torch_dtype="int4")
    # D=8 int4 values packed into 4 bytes
    packed = allocate_cache(dict(config, head_dim=4), 2, 6, torch.uint8)
    assert M.kv_cache_bytes(config, 6, batch_size=2) == packed


# Bad input.
def test_errors_name_the_field_and_model_type():
    with pytest.raises(
        UnsupportedConfigError,
        match="missing field 'hidden_size' / 'n_embd' / 'd_model' for model_type 'llama'",
    ):
        M.kv_cache_bytes(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "torch_dtype": "float16",
            },
            10,
        )
    with pytest.raises(
        UnsupportedConfigError,
        match="model_type 'rwkv' is not supported; kvlib.memory sizes: deepseek_v2",
    ):
        M.layer_specs({"model_type": "rwkv"})
    with pytest.raises(UnsupportedConfigError, match="missing field 'model_type'"):
        M.layer_specs({"num_hidden_layers": 2})
    with pytest.raises(
        UnsupportedConfigError,
        match="sliding_window=4096 but kvlib does not know which layers of a 'llama' model slide",
    ):
        M.layer_specs(dict(CONFIGS["llama-3-8b"], sliding_window=4096))
    with pytest.raises(
        UnsupportedConfigError, match="missing field 'num_kv_heads' for model_type 'falcon'"
    ):
        M.layer_specs(dict(CONFIGS["falcon-7b"], new_decoder_architecture=True))
    with pytest.raises(UnsupportedConfigError, match="layer_types must list 24"):
        M.layer_specs(dict(CONFIGS["gpt-oss-20b"], layer_types=["full_attention"] * 3))
    with pytest.raises(ValueError, match="seq_len: expected an int >= 1, got 0"):
        M.kv_cache_bytes(CONFIGS["llama-3-8b"], 0)
    with pytest.raises(ValueError, match="batch_size: expected an int >= 1, got -2"):
        M.kv_cache_bytes(CONFIGS["llama-3-8b"], 5, batch_size=-2)
    with pytest.raises(
        ValueError,
        match="cache_dtype: expected one of float64, float32, bfloat16, float16, fp8, int8, int4, "
        "got 'int3'",
    ):
        M.kv_cache_bytes(CONFIGS["llama-3-8b"], 5, cache_dtype="int3")
    with pytest.raises(FileNotFoundError, match="no such file"):
        M.load_config("/nonexistent/config.json")


def test_max_concurrent_sequences_equation():
    config = CONFIGS["llama-3-8b"]
    weights = int(8.03e9 * 2)
    budget = M.memory_budget(config, 80 * 10**9, 8192, weight_bytes=weights)
    assert (
        budget.kv_budget_bytes
        == budget.usable_bytes - weights - budget.runtime_overhead_bytes - budget.activation_bytes
    )
    assert budget.max_sequences == budget.kv_budget_bytes // M.kv_cache_bytes(config, 8192)
    assert (
        M.max_concurrent_sequences(config, 80 * 10**9, 8192, weight_bytes=weights)
        == budget.max_sequences
    )
    assert (
        M.max_concurrent_sequences(
            config, 80 * 10**9, 8192, weight_bytes=weights, cache_dtype="fp8"
        )
        >= 2 * budget.max_sequences
    )
    with pytest.raises(ValueError, match="cannot hold weights"):
        M.max_concurrent_sequences(
            CONFIGS["deepseek-v3"], 80 * 10**9, 4096, weight_bytes=671 * 10**9
        )


def test_cli_prints_a_table_and_rejects_bad_input(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "kvlib.memory", "llama-3-8b", "--seq-len", "4096", "--batch", "2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "total: 1.00 GiB (1,073,741,824 bytes)" in done.stdout
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS["gpt2"]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlib.memory",
            str(path),
            "--seq-len",
            "10",
            "--cache-dtype",
            "float16",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "MHA: 2 x 12 KV heads" in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "kvlib.memory", str(path), "--seq-len", "10"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "float32 assumed, as transformers loads it" in done.stdout


def test_a_config_without_a_dtype_is_sized_in_float32_and_says_so():
    gpt2 = CONFIGS["gpt2"]  # the original GPT-2 config.json has no torch_dtype
    assert M.config_dtype(gpt2) is None
    assert M.kv_cache_bytes(gpt2, 1024) == M.kv_cache_bytes(gpt2, 1024, cache_dtype="float32")
    report = M.cache_report(gpt2, 1024)
    assert report.cache_dtype == "float32" and "float32 assumed" in report.table()
    assert M.cache_report(gpt2, 1024, cache_dtype="float16").dtype_assumption is None


# Chapter 17's hybrids: linear-attention states and cross-layer sharing, against hand derivations.
def test_qwen3_next_caches_a_fixed_state_in_three_layers_of_four():
    config = CONFIGS["qwen3-next-80b-a3b"]
    specs = M.layer_specs(config)
    assert [s.kind for s in specs] == ["linear", "linear", "linear", "full"] * 12
    # recurrent state: 32 value heads x 128 x 128; convolution: (2 x 16 x 128 + 32 x 128) x 4
    state = 32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 4
    assert {s.state_elements for s in specs if s.kind == "linear"} == {state}
    for seq_len in (1, 4096, 131072):  # 12 full layers: 2 x 2 heads x 256 dims x 2 bytes per token
        expected = 36 * state * 2 + 12 * 2 * 2 * 256 * 2 * seq_len
        assert M.kv_cache_bytes(config, seq_len, cache_dtype="bfloat16") == expected


def test_gemma_3n_shared_layers_cache_nothing_and_read_the_last_producer_of_their_kind():
    config = CONFIGS["gemma-3n-e4b"]
    specs = M.layer_specs(config)
    assert [s.kind for s in specs[20:]] == ["shared"] * 15
    assert all(s.elements_per_token == 0 and s.state_elements == 0 for s in specs[20:])
    assert "layer 18's sliding" in specs[20].description  # 18: the last sliding layer before 20
    assert "layer 19's full" in specs[24].description  # 19: the last full layer before 20
    # 16 sliding layers hold min(S, 512) tokens and 4 full layers S, 2 x 2 heads x 256 x 2 bytes
    per_token = 2 * 2 * 256 * 2
    for seq_len in (100, 512, 513, 32768):
        expected = per_token * (16 * min(seq_len, 512) + 4 * seq_len)
        assert M.kv_cache_bytes(config, seq_len) == expected
    unshared = {k: v for k, v in config.items() if k != "num_kv_shared_layers"}
    assert M.kv_cache_bytes(unshared, 32768) > M.kv_cache_bytes(config, 32768)


@pytest.mark.parametrize("shared", [35, 40, -1])
def test_shared_layers_out_of_range_are_refused(shared):
    config = dict(CONFIGS["gemma-3n-e4b"], num_kv_shared_layers=shared)
    with pytest.raises(UnsupportedConfigError, match="num_kv_shared_layers"):
        M.layer_specs(config)


def test_gemma_2_alternates_local_and_global_layers():
    specs = M.layer_specs(CONFIGS["gemma-2-9b"])
    assert [s.kind for s in specs] == ["sliding", "full"] * 21
    assert {s.token_cap for s in specs if s.kind == "sliding"} == {4096}
