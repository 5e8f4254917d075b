"""kvlib.layers.mla: the absorbed computation equals the naive one, both equal an explicit per-head
transcription of DeepSeek-V2's equations, caching through either path equals no cache, and the
latent cache holds (d_c + d_R) values per token per layer."""

import math

import pytest
import torch

from kvlib.cache import DynamicCache
from kvlib.cache.latent import LatentCache
from kvlib.errors import UnsupportedConfigError
from kvlib.generation import generate
from kvlib.layers.llama import apply_rope, rope_cos_sin
from kvlib.layers.mla import set_absorb
from kvlib.loaders.hf import load_hf_checkpoint, save_hf_checkpoint
from kvlib.memory import kv_cache_bytes
from kvlib.model import LlamaModel, ModelConfig
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


# --- costs, conversion, the recorded sweep ------------------------------------------------------


def counted_attention_flops(absorb: bool, t: int, s: int) -> int:
    """torch's FLOP counter on one MLA layer computing t new tokens over s, minus the projections
    that attention_cost leaves out."""
    from torch.utils.flop_counter import FlopCounterMode

    attn = mla_model().model.layers[0].self_attn.requires_grad_(False)
    attn.absorb = absorb
    x, cos, sin, mask = layer_inputs(torch.float32, t=s)
    x, cos, sin = x[:1], cos[:1], sin[:1]
    cache = LatentCache(2) if absorb else DynamicCache(2)
    past = slice(0, s - t)
    attn(x[:, past], cos[:, past], sin[:, past], mask[:, past, past], cache)
    with FlopCounterMode(display=False) as counter:
        attn(x[:, s - t :], cos[:, s - t :], sin[:, s - t :], mask[:, s - t :], cache)
    n, d_model = 4, MLA.hidden_size
    projections = 2 * t * d_model * (n * (16 + 8) + 32 + 8 + n * 12)
    return counter.get_total_flops() - projections


@pytest.mark.parametrize("t,s", [(1, 9), (4, 9), (9, 9)])
def test_attention_cost_counts_what_the_layer_computes(t, s):
    from kvlib.layers.mla import attention_cost

    assert attention_cost(MLA, t, s, "absorbed")["flops"] == counted_attention_flops(True, t, s)
    naive = attention_cost(MLA, t, s, "expanded_cache")["flops"]
    assert naive == counted_attention_flops(False, t, s)
    if t == s:  # a whole prefill: the naive layer expands every token, as "expanded" does
        assert attention_cost(MLA, t, s, "expanded")["flops"] == naive
    assert attention_cost(MLA, t, s, "absorbed", dtype_bytes=4)["bytes_read"] == s * 40 * 4
    assert attention_cost(MLA, t, s, "expanded_cache")["bytes_read"] == s * 4 * (16 + 8 + 12) * 2


def test_attention_cost_and_crossover_validate_and_agree():
    from kvlib.layers.mla import absorption_crossover, attention_cost

    with pytest.raises(ValueError, match="mode: expected one of"):
        attention_cost(MLA, 1, 4, "fused")
    with pytest.raises(ValueError, match="context_tokens: expected at least query_tokens=5"):
        attention_cost(MLA, 5, 4, "absorbed")
    with pytest.raises(ValueError, match="config: expected an MLA config"):
        attention_cost(TINY_MHA, 1, 4, "absorbed")
    s = 300
    t = absorption_crossover(MLA, s)
    cost = lambda t, mode: attention_cost(MLA, t, s, mode)["flops"]  # noqa: E731
    assert 1 < t <= s
    assert cost(t, "expanded") <= cost(t, "absorbed") and cost(t - 1, "expanded") > cost(
        t - 1, "absorbed"
    )


TINY_MHA = ModelConfig(
    vocab_size=128,  # the course data's vocabulary
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
)


def test_decoupled_rope_dims_rotate_exactly_as_the_full_head_did():
    from kvlib.layers.mla import decoupled_rope_dims

    d, d_r = 32, 8
    nope, rope = decoupled_rope_dims(d, d_r)
    assert sorted(nope + rope) == list(range(d)) and len(rope) == d_r
    x = torch.randn(1, 2, 20, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(20)[None]
    full = apply_rope(x, *rope_cos_sin(positions, d, 10000.0))
    decoupled = apply_rope(x[..., rope], *rope_cos_sin(positions, d_r, 10000.0))
    assert_close(decoupled, full[..., rope], name="kept dimensions", rtol=1e-12, atol=1e-12)
    with pytest.raises(
        ValueError, match="rope_dim: expected an even divisor of head_dim 32, got 12"
    ):
        decoupled_rope_dims(32, 12)


def test_conversion_keeps_queries_and_factorises_keys_and_values():
    """At full rank the latent reproduces every head's content keys and values; queries are
    permuted, not changed; the rotary key is the heads' mean."""
    from kvlib.conversions.mla import convert_to_mla
    from kvlib.layers.mla import decoupled_rope_dims

    mha = tiny_model(TINY_MHA, 0).double()
    mla = convert_to_mla(mha, 64, 8)  # 64 = d_model: lossless
    nope, rope = decoupled_rope_dims(16, 8)
    x = torch.randn(50, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for old, new in zip(mha.model.layers, mla.model.layers, strict=True):
        old, new = old.self_attn, new.self_attn
        q_old = old.q_proj(x).view(50, 4, 16)
        q_new = new.q_proj(x).view(50, 4, 16)
        permuted = torch.cat([q_old[..., nope], q_old[..., rope]], -1)
        assert_close(q_new, permuted, name="queries", rtol=1e-12, atol=1e-12)
        latent, rope_key = new.kv_a_proj_with_mqa(x).split([64, 8], dim=-1)
        k_old, v_old = old.k_proj(x).view(50, 4, 16), old.v_proj(x).view(50, 4, 16)
        expanded = new.kv_b_proj(latent).view(50, 4, 8 + 16)
        assert_close(expanded[..., :8], k_old[..., nope], name="content keys", rtol=1e-9, atol=1e-9)
        assert_close(expanded[..., 8:], v_old, name="values", rtol=1e-9, atol=1e-9)
        assert_close(rope_key, k_old[..., rope].mean(1), name="rotary key", rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="model: expected multi-head attention"):
        convert_to_mla(mla, 32, 8)
    with pytest.raises(ValueError, match="kv_lora_rank: expected at most 96"):
        convert_to_mla(mha, 97, 8)


def test_uptraining_point_validates_attention():
    from kvlib.experiments.mla_uptraining import uptraining_point

    with pytest.raises(ValueError, match="attention: expected 'MLA' with a kv_lora_rank"):
        uptraining_point("MLA", 0.0)
    with pytest.raises(ValueError, match="attention: expected 'MLA' with a kv_lora_rank"):
        uptraining_point("GQA-4", 0.0)


@pytest.mark.recorded
def test_recorded_mla_sweep_is_complete_and_reproduced():
    """CI recomputes points of `results/mla_uptraining.csv` (`python -m
    kvlib.experiments.mla_uptraining`): a conversion without uptraining, which must match to
    round-off, one short uptraining run, within what another CPU's reduction order can move it, and
    the shipped checkpoint, which must evaluate to its row."""
    import csv
    from pathlib import Path

    from kvlib.experiments.mla_uptraining import sweep_points, uptraining_point
    from kvlib.loaders.course_model import load_course_mla_model
    from kvlib.training import evaluate

    with (Path(__file__).resolve().parents[1] / "results" / "mla_uptraining.csv").open() as f:
        rows = list(csv.DictReader(f))
    keys = [(r["attention"], float(r["alpha"]), int(r["kv_lora_rank"] or 0) or None) for r in rows]
    assert keys == sweep_points()
    by_key = dict(zip(keys, rows, strict=True))

    def matches(loss, recall, recorded, loss_tol, recall_tol):
        assert abs(float(recorded["heldout_loss"]) - loss) <= loss_tol
        for distance in (8, 64, 240):
            assert abs(float(recorded[f"recall_{distance}"]) - recall[distance]) <= recall_tol

    for key, loss_tol, recall_tol in [
        (("MLA", 0.0, 112), 1e-4, 0.02),
        (("MLA", 0.01, 48), 0.01, 0.1),
    ]:
        fresh = uptraining_point(key[0], key[1], kv_lora_rank=key[2])
        recorded = by_key[key]
        assert int(recorded["uptrain_steps"]) == fresh["uptrain_steps"]
        assert int(recorded["kv_bytes_per_token"]) == fresh["kv_bytes_per_token"]
        recall = {d: fresh[f"recall_{d}"] for d in (8, 64, 240)}
        matches(fresh["heldout_loss"], recall, recorded, loss_tol, recall_tol)
    shipped = evaluate(load_course_mla_model())
    recorded = by_key[("MLA", 0.25, 112)]
    matches(shipped["heldout_loss"], shipped["recall_accuracy"], recorded, 1e-4, 0.02)


def test_course_mla_model_runs_on_the_grouped_backend_as_on_the_reference():
    """The grouped backend reads the one latent "KV head" once instead of repeating it H times;
    the logits are the reference backend's to round-off, and an unknown name fails early."""
    from kvlib.loaders.course_model import load_course_mla_model

    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    reference = load_course_mla_model()
    grouped = load_course_mla_model(attention_backend="grouped")
    assert reference.attention_backend == "reference" and grouped.attention_backend == "grouped"
    with torch.no_grad():
        assert_close(grouped(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention_backend"):
        load_course_mla_model(attention_backend="flash")
