"""kvlib.conversions.gqa and grouped attention (chapter 5): grouped attention against the
repeat-K/V reference and PyTorch's SDPA, the conversion against explicit loops and transformers'
Llama, and the committed sweeps reproduced."""

import csv
import json
from pathlib import Path

import pytest
import torch

from kvlib.cache import StaticCache
from kvlib.conversions.gqa import convert_kv_heads, pool_kv_heads
from kvlib.course.bench import torch_allocated_bytes
from kvlib.experiments.gqa_smollm2 import smollm2_variant_metrics, smollm2_variants
from kvlib.experiments.gqa_uptraining import uptraining_point
from kvlib.loaders.hf import load_hf_checkpoint, save_hf_checkpoint
from kvlib.memory import kv_cache_bytes
from kvlib.model import ModelConfig
from kvlib.ops.attention import grouped_attention, reference_attention, sdpa_attention
from kvlib.testing import assert_close
from kvlib.training import uptrain
from tests.test_model import TINY, prompts, tiny_model

RESULTS = Path(__file__).resolve().parents[1] / "results"
MHA = ModelConfig(**{**TINY.__dict__, "num_key_value_heads": 4, "num_attention_heads": 4})


def qkv(batch, heads, kv_heads, queries, keys, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, dim, generator=g)
    k = torch.randn(batch, kv_heads, keys, dim, generator=g)
    v = torch.randn(batch, kv_heads, keys, dim, generator=g)
    mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)[None]
    return q, (k, v), mask


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])  # MHA, GQA-4, GQA-2, MQA
@pytest.mark.parametrize("queries,keys", [(1, 33), (5, 5), (4, 19)])  # decode, prefill, chunk
def test_grouped_attention_equals_repeating_kv_and_sdpa(kv_heads, queries, keys):
    q, kv, mask = qkv(2, 8, kv_heads, queries, keys)
    weights = [], []
    expected = reference_attention(q, kv, mask, weights_out=weights[0])
    got = grouped_attention(q, kv, mask, weights_out=weights[1])
    assert_close(got, expected, name="grouped vs repeated K/V", rtol=1e-5, atol=1e-6)
    assert_close(weights[1][0], weights[0][0], name="attention weights", rtol=1e-5, atol=1e-6)
    assert_close(sdpa_attention(q, kv, mask), expected, name="sdpa", rtol=1e-5, atol=1e-5)


def test_grouped_heads_are_consecutive():
    """Query head h reads KV head h // G: zeroing KV head 1's values changes heads 2 and 3 only
    (H = 4, H_kv = 2)."""
    q, (k, v), mask = qkv(1, 4, 2, 3, 7)
    before = grouped_attention(q, (k, v), mask)
    v = v.clone()
    v[:, 1] = 0
    after = grouped_attention(q, (k, v), mask)
    assert torch.equal(after[:, :2], before[:, :2])
    assert torch.all(after[:, 2:] == 0) and not torch.all(before[:, 2:] == 0)


def test_grouped_attention_allocates_no_repeated_kv():
    q, kv, mask = qkv(1, 8, 2, 1, 4096, dim=64)
    repeated_bytes = 2 * 8 * 4096 * 64 * 4  # K and V repeated to H = 8 heads, fp32
    reference = torch_allocated_bytes(lambda: reference_attention(q, kv, mask))
    grouped = torch_allocated_bytes(lambda: grouped_attention(q, kv, mask))
    assert reference >= repeated_bytes > 8 * grouped, (reference, grouped)


def test_pool_kv_heads_against_explicit_loops():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(6 * 4, 10, generator=g)  # 6 KV heads of D = 4, d_model 10
    heads = weight.view(6, 4, 10)
    mean = pool_kv_heads(weight, 2, head_dim=4)
    first = pool_kv_heads(weight, 2, head_dim=4, init="first")
    for j in range(2):  # new head j pools old heads 3j, 3j+1, 3j+2
        assert_close(mean[4 * j : 4 * j + 4], sum(heads[3 * j + i] for i in range(3)) / 3,
                     name=f"mean head {j}", rtol=1e-6, atol=1e-6)  # fmt: skip
        assert torch.equal(first[4 * j : 4 * j + 4], heads[3 * j])
    random = pool_kv_heads(weight, 3, head_dim=4, init="random", generator=g)
    assert random.shape == (12, 10) and 0.5 < random.std() / weight.std() < 1.5
    bias = torch.arange(24.0)
    assert torch.equal(pool_kv_heads(bias, 6, head_dim=4), bias)  # no pooling: unchanged
    assert torch.equal(pool_kv_heads(bias, 1, head_dim=4), bias.view(6, 4).mean(0))
    with pytest.raises(
        ValueError, match="num_kv_heads: expected a divisor of the weight's 6 heads"
    ):
        pool_kv_heads(weight, 4, head_dim=4)
    with pytest.raises(ValueError, match="head_dim: expected a divisor of weight's 24 rows, got 5"):
        pool_kv_heads(weight, 2, head_dim=5)
    with pytest.raises(ValueError, match=r"init: expected one of \('mean', 'first', 'random'\)"):
        pool_kv_heads(weight, 2, head_dim=4, init="max")
    with pytest.raises(TypeError, match="weight: expected a floating-point tensor, got list"):
        pool_kv_heads([1.0], 1, head_dim=1)


def test_converting_without_pooling_reproduces_mha_exactly():
    model = tiny_model(MHA)
    same = convert_kv_heads(model, 4)
    tokens = prompts(length=12)
    assert torch.equal(same(tokens), model(tokens))


def test_conversion_is_exact_when_a_groups_heads_agree():
    """If the heads of each group already have equal K and V projections, GQA loses nothing:
    the mean-pooled model gives the MHA model's logits. Pooling strided heads would not."""
    model = tiny_model(MHA)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                heads = proj.weight.view(4, MHA.head_dim, -1)
                heads[1], heads[3] = heads[0], heads[2]  # groups {0, 1} and {2, 3}
    tokens = prompts(length=12)
    gqa = convert_kv_heads(model, 2)
    assert gqa.config.num_key_value_heads == 2
    assert_close(gqa(tokens), model(tokens), name="GQA-2 vs MHA", rtol=1e-5, atol=1e-5)
    assert model.model.layers[0].self_attn.k_proj.weight.shape[0] == 4 * MHA.head_dim  # untouched
    with pytest.raises(ValueError, match="num_kv_heads: expected a divisor of the model's"):
        convert_kv_heads(model, 3)


def test_converted_checkpoint_round_trips_through_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    mqa = convert_kv_heads(tiny_model(MHA), 1)
    save_hf_checkpoint(mqa, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_key_value_heads"] == 1
    ours = load_hf_checkpoint(tmp_path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = prompts(length=12)
    with torch.no_grad():
        assert torch.equal(ours(tokens), mqa(tokens))
        assert_close(theirs(tokens).logits, mqa(tokens), name="transformers", rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "config.json").read_text())
    cache = StaticCache.for_model(ours, 2, 40)
    assert cache.nbytes == kv_cache_bytes(config, 40, batch_size=2) == 2 * 3 * 1 * 16 * 4 * 80


def test_uptrain_validates_alpha():
    with pytest.raises(ValueError, match="fraction: expected a positive number, got 0"):
        uptrain(tiny_model(), 0)


def recorded_rows():
    with (RESULTS / "gqa_uptraining.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.recorded
def test_recorded_uptraining_sweep_is_complete_and_reproduced():
    """CI recomputes two points of `results/gqa_uptraining.csv` (`python -m
    kvlib.experiments.gqa_uptraining`): a conversion without uptraining, which must match to
    round-off, and one short uptraining run, which must match within what a different CPU's
    reduction order can move it."""
    rows = recorded_rows()
    assert len(rows) == 35 and {r["init"] for r in rows} == {"none", "mean", "first", "random"}
    by_key = {(int(r["num_kv_heads"]), r["init"], float(r["alpha"])): r for r in rows}
    for key, loss_tol, recall_tol in [
        ((1, "mean", 0.0), 1e-4, 1e-9),
        ((2, "mean", 0.01), 0.01, 0.1),
    ]:
        fresh = uptraining_point(*key)
        recorded = by_key[key]
        assert int(recorded["uptrain_steps"]) == fresh["uptrain_steps"]
        assert int(recorded["kv_bytes_per_token"]) == fresh["kv_bytes_per_token"]
        assert abs(float(recorded["heldout_loss"]) - fresh["heldout_loss"]) <= loss_tol, key
        for distance in (8, 64, 240):
            column = f"recall_{distance}"
            assert abs(float(recorded[column]) - fresh[column]) <= recall_tol, (key, column)


@pytest.mark.recorded
def test_recorded_smollm2_conversion_is_reproduced(smollm2):
    """CI recomputes the text metrics of every variant in `results/gqa_smollm2.json` and one of
    the MQA model's passkey trials."""
    from kvlib.metrics.passkey import passkey_trial

    model, tokenizer = smollm2
    recorded = json.loads((RESULTS / "gqa_smollm2.json").read_text())
    variants = smollm2_variants(model)
    assert [v["name"] for v in recorded["variants"]] == list(variants)
    for entry in recorded["variants"]:
        fresh = smollm2_variant_metrics(variants[entry["name"]], model, tokenizer)
        for field in ("perplexity", "top1_agreement", "mean_kl_nats"):
            assert abs(fresh[field] - entry[field]) <= 2e-3 * max(1, abs(entry[field])), field
    mqa = recorded["variants"][1]
    trial = mqa["passkey"][0]
    correct, prompt_tokens = passkey_trial(
        variants[mqa["name"]], tokenizer, trial["filler_tokens"], trial["depth"], trial["passkey"]
    )
    assert (correct, prompt_tokens) == (trial["correct"], trial["prompt_tokens"])
