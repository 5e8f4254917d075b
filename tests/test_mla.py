"""kvlib.mla: the absorbed computation equals the naive one, both equal an explicit per-head
transcription of DeepSeek-V2's equations, caching through either path equals no cache, and the
latent cache holds (d_c + d_R) values per token per layer."""

import math

import pytest
import torch

from kvlib.cache import DynamicCache
from kvlib.cache.latent import LatentCache
from kvlib.errors import UnsupportedConfigError
from kvlib.generation import generate
from kvlib.memory import kv_cache_bytes
from kvlib.model import (
    LlamaModel,
    ModelConfig,
    apply_rope,
    load_hf_checkpoint,
    rope_cos_sin,
    save_hf_checkpoint,
)
from kvlib.testing import assert_close
from tests.test_model import tiny_model

MLA = ModelConfig(
    vocab_size=50,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)


def mla_model(dtype=torch.float32, seed=0, backend="reference") -> LlamaModel:
    # random norms (tiny_model), so that a skipped RMSNorm on the latent cannot hide behind ones
    return tiny_model(MLA, seed, attention_backend=backend).to(dtype)


def set_absorb(model, absorb: bool) -> None:
    for layer in model.model.layers:
        layer.self_attn.absorb = absorb


def layer_inputs(dtype, t=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, t, MLA.hidden_size, generator=g).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(t).expand(2, t), MLA.qk_rope_head_dim, 10000.0)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    return x, cos.to(dtype), sin.to(dtype), mask


def explicit_mla(attn, x, cos, sin):
    """DeepSeek-V2's equations (9)-(19), one head and one query at a time."""
    b, t, _ = x.shape
    n, d_c, d_h, d_r, d_v = 4, 32, 16, 8, 12
    w_dkv, w_kr = attn.kv_a_proj_with_mqa.weight.split([d_c, d_r])
    w_b = attn.kv_b_proj.weight.view(n, d_h + d_v, d_c)
    w_q = attn.q_proj.weight.view(n, d_h + d_r, -1)
    c = attn.kv_a_layernorm(x @ w_dkv.T)  # (B, T, d_c)
    k_r = apply_rope((x @ w_kr.T)[:, None], cos, sin)[:, 0]  # (B, T, d_R), shared by the heads
    heads = []
    for i in range(n):
        q = x @ w_q[i].T  # (B, T, d_h + d_R)
        q_c, q_r = q[..., :d_h], apply_rope(q[..., d_h:][:, None], cos, sin)[:, 0]
        k_c, v = c @ w_b[i, :d_h].T, c @ w_b[i, d_h:].T  # (B, T, d_h), (B, T, d_v)
        out = torch.zeros(b, t, d_v, dtype=x.dtype)
        for s in range(t):
            scores = (k_c[:, : s + 1] @ q_c[:, s, :, None])[..., 0] + (
                k_r[:, : s + 1] @ q_r[:, s, :, None]
            )[..., 0]
            weights = torch.softmax(scores / math.sqrt(d_h + d_r), dim=-1)  # (B, s + 1)
            out[:, s] = (weights[..., None] * v[:, : s + 1]).sum(1)
        heads.append(out)
    return attn.o_proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("absorb", [False, True])
def test_both_paths_equal_the_papers_equations_in_fp64(absorb):
    attn = mla_model(torch.float64).model.layers[0].self_attn
    attn.absorb = absorb
    x, cos, sin, mask = layer_inputs(torch.float64)
    with torch.no_grad():
        got, expected = attn(x, cos, sin, mask), explicit_mla(attn, x, cos, sin)
    assert_close(got, expected, name=f"MLA (absorb={absorb})", rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 0.1)]
)
def test_absorbed_equals_naive(dtype, tolerance):
    """fp64: round-off; fp32: 1e-5; bf16: the two orders of rounding measurably diverge (the
    bound is what a bf16 layer output of magnitude ~1 allows, not equality)."""
    attn = mla_model(dtype).model.layers[0].self_attn
    x, cos, sin, mask = layer_inputs(dtype)
    with torch.no_grad():
        attn.absorb = True
        absorbed = attn(x, cos, sin, mask)
        attn.absorb = False
        naive = attn(x, cos, sin, mask)
    assert_close(absorbed.double(), naive.double(), name=f"absorbed vs naive in {dtype}",
                 rtol=0, atol=tolerance)  # fmt: skip
    if dtype == torch.bfloat16:
        assert not torch.equal(absorbed, naive)  # the divergence is real, and measured above


@pytest.mark.parametrize("backend", ["reference", "grouped", "sdpa"])
def test_cached_decoding_through_either_path_equals_no_cache(backend):
    model = mla_model(backend=backend)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        for absorb, cache in ((True, LatentCache(2)), (False, DynamicCache(2))):
            set_absorb(model, absorb)
            pieces = [model(ids[:, :7], cache=cache)]
            pieces += [model(ids[:, i : i + 1], cache=cache) for i in range(7, 12)]
            assert_close(torch.cat(pieces, 1), full, name=f"cached, absorb={absorb}",
                         rtol=1e-5, atol=1e-5)  # fmt: skip
    set_absorb(model, True)
    cached = generate(model, ids[:, :5], 6, cache=lambda m, b, s: LatentCache(2))
    assert torch.equal(cached, generate(model, ids[:, :5], 6, use_cache=False))


def test_latent_cache_bytes_equal_the_formula():
    model = mla_model()
    ids = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(4))
    latent, dense = LatentCache(2), DynamicCache(2)
    with torch.no_grad():
        model(ids, cache=latent)
        set_absorb(model, False)
        model(ids, cache=dense)
    per_token_latent = 2 * (32 + 8) * 4  # L x (d_c + d_R) x 4 bytes
    assert latent.nbytes == per_token_latent * 30 == kv_cache_bytes(MLA.to_hf(), 10, batch_size=3)
    assert dense.nbytes == 2 * 4 * (16 + 8 + 12) * 4 * 30  # L x H x (d_h + d_R + d_v) x 4 bytes
    rows, values = latent.update(0, torch.zeros(3, 1, 1, 32), torch.zeros(3, 1, 1, 8))
    assert rows.shape == (3, 1, 11, 40) and values.shape == (3, 1, 11, 32)
    assert values.data_ptr() == rows.data_ptr()  # the values are a view of the rows
    with pytest.raises(ValueError, match="latent: expected \\(B, 1, T, d_c\\)"):
        latent.update(0, torch.zeros(3, 2, 1, 32), torch.zeros(3, 2, 1, 8))
    with pytest.raises(ValueError, match="expected widths 32 and 8"):
        latent.update(0, torch.zeros(3, 1, 1, 30), torch.zeros(3, 1, 1, 8))


def test_mla_config_round_trips_and_refuses_what_it_cannot_run(tmp_path):
    model = mla_model()
    save_hf_checkpoint(model, tmp_path)
    reloaded = load_hf_checkpoint(tmp_path)
    ids = torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(reloaded(ids), model(ids))
    config = MLA.to_hf()
    assert config["model_type"] == "deepseek_v2" and config["kv_lora_rank"] == 32
    with pytest.raises(UnsupportedConfigError, match="q_lora_rank"):
        ModelConfig.from_hf(dict(config, q_lora_rank=16))
    with pytest.raises(UnsupportedConfigError, match="mixture-of-experts"):
        ModelConfig.from_hf(dict(config, n_routed_experts=8, first_k_dense_replace=1))
    with pytest.raises(ValueError, match="kv_lora_rank: MLA needs all of"):
        ModelConfig(kv_lora_rank=32, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match="qk_rope_head_dim: RoPE needs an even dimension, got 7"):
        ModelConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=7, v_head_dim=12)
