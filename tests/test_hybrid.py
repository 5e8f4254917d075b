"""Hybrid models (chapter 17): `ModelConfig.layer_types` (`kvlib.layers.hybrid`) and their cache
(`kvlib.cache.HybridCache`) against oracles: the cached path equals the uncached full forward
across chunked prefills (chunks below, at and above the window and the linear layers' chunk of
64) and decode, greedy generation token for token; the cache's bytes equal chapter 3's equation
layer by layer; layer_types=None leaves the config, the checkpoint and the model as they were;
every refusal names its argument. The last test recomputes points of
`results/hybrid_recall.csv` from the shipped weights (marked `recorded`).

Models: a hybrid of the course model's sizes, randomly initialised from a seed (an equality test
needs no training), and the shipped hybrid course model.

Tolerances: the cached and uncached paths add the same terms in different orders and groupings
(the ring attends over n + T keys instead of length + T, the linear layers sum chunks of other
lengths, the recurrent form multiplies decays one at a time where the chunked form takes exp of a
sum). In float32 that is round-off of order 1e-6 on logits of order 1-10 after four layers; we
allow atol = rtol = 1e-4. In float64 the same comparison holds to 1e-10. Greedy tokens are
compared exactly.
"""

import dataclasses
import json
import re

import pytest
import torch

from kvlib.cache import DynamicCache, HybridCache, RingCache
from kvlib.generation import generate
from kvlib.layers.hybrid import GlobalAttention, LinearAttention
from kvlib.layers.llama import Attention
from kvlib.loaders.course_model import COURSE_CONFIG, HYBRID_CONFIG
from kvlib.loaders.hf import load_hf_checkpoint, save_hf_checkpoint
from kvlib.memory import kv_cache_bytes, layer_specs
from kvlib.model import LlamaModel, ModelConfig
from kvlib.testing import assert_close

W = HYBRID_CONFIG.sliding_window  # 16
FLOAT32 = {"rtol": 1e-4, "atol": 1e-4}
FLOAT64 = {"rtol": 1e-10, "atol": 1e-10}
NUM_TOKENS = 150  # crosses the window nine times and the linear layers' chunk of 64 twice
CHUNKS = (1, 5, W, W + 1, 64, 100, NUM_TOKENS)


def hybrid(dtype=torch.float32, seed: int = 0, **changes) -> LlamaModel:
    """A randomly initialised model of `HYBRID_CONFIG` (with `changes`), in eval mode."""
    torch.manual_seed(seed)
    return LlamaModel(dataclasses.replace(HYBRID_CONFIG, **changes)).to(dtype).eval()


def token_ids(batch: int = 2, length: int = NUM_TOKENS, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def streamed(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Logits (B, T, V) of `ids` fed to `model` through `cache` in chunks of `chunk` tokens."""
    return torch.cat(
        [model(ids[:, s : s + chunk], cache=cache) for s in range(0, ids.shape[1], chunk)], dim=1
    )


# --- layer_types=None: today's model, unchanged -------------------------------------------------


def test_without_layer_types_the_config_checkpoint_and_model_are_as_before():
    assert ModelConfig().layer_types is None and COURSE_CONFIG.layer_types is None
    hf = COURSE_CONFIG.to_hf()
    assert not {k for k in hf if k == "layer_types" or k.startswith("linear_")}, sorted(hf)
    assert ModelConfig.from_hf(hf) == COURSE_CONFIG
    model = LlamaModel(COURSE_CONFIG)
    assert all(type(layer.self_attn) is Attention for layer in model.model.layers)
    assert not model._forward_pre_hooks, "a model without layer_types has no input hook"
    assert model.num_parameters == 836_736  # the course model's count (COURSE.md: 836k)


def test_a_uniform_layer_types_list_in_a_config_reads_as_none():
    """A Qwen2 config of recent transformers lists full_attention for every layer: nothing
    hybrid, so the model type's own rules decide, as before the field existed."""
    hf = {**COURSE_CONFIG.to_hf(), "layer_types": ["full_attention"] * 4}
    assert ModelConfig.from_hf(hf).layer_types is None


# --- the config field ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"layer_types": ("full", "linear", "full")}, "expected 4 (num_hidden_layers)"),
        ({"layer_types": ("full", "mamba", "full", "full")}, "expected 4 (num_hidden_layers)"),
        ({"layer_types": "full"}, "expected a sequence"),
        ({"layer_types": ("sliding",) * 4, "sliding_window": None}, "sliding_window: expected"),
        ({"layer_types": ("full", "linear") * 2, "sliding_window": 8}, "sliding_window: expected"),
    ],
)
def test_bad_layer_types_are_refused_by_name(changes, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        dataclasses.replace(HYBRID_CONFIG, **changes)


def test_layer_types_become_a_tuple_and_each_layer_its_kind():
    config = dataclasses.replace(
        HYBRID_CONFIG, layer_types=["sliding", "linear", "sliding", "full"]
    )
    assert config.layer_types == ("sliding", "linear", "sliding", "full")
    kinds = [type(layer.self_attn) for layer in LlamaModel(config).model.layers]
    assert kinds == [Attention, LinearAttention, Attention, GlobalAttention]
    no_window = dataclasses.replace(config, layer_types=("full", "linear") * 2, sliding_window=None)
    kinds = [type(layer.self_attn) for layer in LlamaModel(no_window).model.layers]
    assert kinds == [Attention, LinearAttention] * 2  # no windowed mask to undo


def test_a_linear_layer_costs_its_gate_and_norm_more_than_attention():
    heads, d, d_model = 4, 32, 128
    gate_and_norm = heads * d_model + heads + d  # gate_proj weight and bias, norm weight
    assert hybrid().num_parameters - LlamaModel(COURSE_CONFIG).num_parameters == gate_and_norm


def test_layer_types_round_trip_through_a_checkpoint(tmp_path):
    model = hybrid()
    save_hf_checkpoint(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["layer_types"] == [
        "sliding_attention",
        "full_attention",
        "linear_attention",
        "full_attention",
    ]
    assert (hf["linear_num_value_heads"], hf["linear_key_head_dim"]) == (4, 32)
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.config == model.config
    ids = token_ids(1, 40)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


# --- the cached path equals the uncached forward ------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@torch.no_grad()
def test_hybrid_cache_logits_equal_the_uncached_forward(chunk):
    model, ids = hybrid(), token_ids()
    oracle = model(ids)  # (B, T, V): every layer's own mask or recurrence, no cache
    logits = streamed(model, ids, HybridCache.for_model(model), chunk)
    assert_close(logits, oracle, name=f"hybrid cache, chunks of {chunk}", **FLOAT32)
    assert torch.equal(logits.argmax(-1), oracle.argmax(-1)), "greedy tokens differ"


@pytest.mark.parametrize("chunk", (1, W + 1, 64))
@torch.no_grad()
def test_hybrid_cache_in_float64_equals_the_uncached_forward_to_round_off(chunk):
    model, ids = hybrid(torch.float64), token_ids()
    logits = streamed(model, ids, HybridCache.for_model(model), chunk)
    assert_close(logits, model(ids), name=f"float64, chunks of {chunk}", **FLOAT64)


@torch.no_grad()
def test_each_kind_changes_the_outputs_so_the_equality_is_not_vacuous():
    """Windowing the full layers, or making the linear layer windowed attention too, changes the
    logits after the first window; a wrong mask or a state that forgets would show."""
    model, ids = hybrid(), token_ids()
    reference = model(ids)
    for layer_types in (("sliding", "sliding", "linear", "sliding"), ("sliding",) * 4):
        other = LlamaModel(dataclasses.replace(model.config, layer_types=layer_types)).eval()
        other.load_state_dict(model.state_dict(), strict=False)  # a linear layer's q/k/v/o too
        difference = (other(ids) - reference).abs().amax(dim=(0, 2))  # (T,)
        assert difference[W:].max() > 1e-2, f"{layer_types}: no difference past the window"


@pytest.mark.parametrize("prefill_chunk_size", (None, 7))
def test_greedy_generation_with_the_hybrid_cache_equals_the_uncached_path(prefill_chunk_size):
    model, prompt = hybrid(seed=1), token_ids(2, 37, seed=3)
    cached = generate(
        model, prompt, 40, cache=HybridCache.factory, prefill_chunk_size=prefill_chunk_size
    )
    assert torch.equal(cached, generate(model, prompt, 40, use_cache=False))


@torch.no_grad()
def test_repeat_and_reorder_copy_every_kind_of_layer():
    model, ids = hybrid(), token_ids(2, 30)
    cache = HybridCache.for_model(model)
    model(ids, cache=cache)
    copies = cache.repeat(2)  # rows 0, 0, 1, 1
    copies.reorder(torch.tensor([3, 0]))  # rows 1, 0
    step = torch.tensor([[5], [9]])
    assert_close(
        model(step, cache=copies),
        model(step.flip(0), cache=cache).flip(0),
        name="repeated then reordered",
        **FLOAT32,
    )
    assert copies.seq_lens.tolist() == [31, 31]


# --- bytes: the equation, layer by layer --------------------------------------------------------


@torch.no_grad()
def test_hybrid_cache_bytes_follow_chapter_3s_equation_and_only_the_full_layer_grows():
    model = hybrid()
    cache, ids, seen = HybridCache.for_model(model), token_ids(3, 100), 0
    per_token = 2 * (2 * 4 * 32 * 4)  # two full layers: K and V, 4 KV heads of 32, float32
    fixed = 2 * 4 * W * 32 * 4 + 4 * 32 * 32 * 4  # a ring of W, a 4 x 32 x 32 state
    for chunk in (1, 9, 30, 60):
        model(ids[:, seen : seen + chunk], cache=cache)
        seen += chunk
        kinds = cache.nbytes_by_kind()
        assert kinds == {"full": 3 * per_token * seen, "sliding": 3 * 2 * 4 * W * 32 * 4,
                         "linear": 3 * 4 * 32 * 32 * 4}, (seen, kinds)  # fmt: skip
        assert cache.nbytes == 3 * (fixed + per_token * seen)
        # the equation counts min(S, W) tokens per sliding layer; the ring allocates its W
        # slots at the first token, so below W it holds the empty slots too
        empty_slots = 3 * 2 * 4 * max(0, W - seen) * 32 * 4
        assert cache.nbytes == kv_cache_bytes(model.config.to_hf(), seen, 3) + empty_slots, seen
    kinds = [spec.kind for spec in layer_specs(model.config.to_hf())]
    assert kinds == ["sliding", "full", "linear", "full"]


# --- refusals -----------------------------------------------------------------------------------


def test_a_hybrid_refuses_padding_trees_and_caches_that_hold_no_state():
    model, ids = hybrid(), token_ids(2, 12)
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    with pytest.raises(ValueError, match="attention_mask: a hybrid model"):
        model(ids, attention_mask=padded)
    with pytest.raises(ValueError, match="attention_mask: a hybrid model"):
        generate(model, ids, 2, attention_mask=padded, cache=HybridCache.factory)
    with pytest.raises(ValueError, match="tree_mask: a hybrid model"):
        model(ids, tree_mask=torch.ones(12, 12, dtype=torch.bool).tril())
    with pytest.raises(TypeError, match="cache: layer 2 is linear attention"):
        model(ids, cache=DynamicCache(4))
    with pytest.raises(ValueError, match="use kvlib.cache.HybridCache"):
        RingCache.for_model(model)
    with pytest.raises(ValueError, match="model: expected a config with layer_types"):
        HybridCache.for_model(LlamaModel(COURSE_CONFIG))


def test_hybrid_cache_refuses_the_wrong_call_for_a_layer_and_rollback():
    cache = HybridCache(("sliding", "linear", "full"), 4)
    k = v = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="layer_idx: layer 1 is 'linear'; update serves"):
        cache.update(1, k, v)
    with pytest.raises(ValueError, match="layer_idx: layer 2 is 'full'; update_state serves"):
        cache.update_state(2, k, k, v, torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"layer_idx: expected an int in \[0, 3\)"):
        cache.update(3, k, v)
    with pytest.raises(NotImplementedError, match="does not roll back"):
        cache.truncate(0)
    with pytest.raises(ValueError, match="window: expected an int exactly when"):
        HybridCache(("sliding", "full"))
    with pytest.raises(ValueError, match="layer_types: expected one of"):
        HybridCache(("full", "mamba"))


def test_one_training_step_on_the_corpus_is_finite():
    from kvlib.training import Phase, fit

    model = hybrid()
    log = fit(model, (Phase("drills", 2, 4, True, 1.0),), eval_every=None, progress=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert len(log) == 2 and all(entry["loss"] == entry["loss"] for entry in log)  # not NaN


# --- the shipped model and its recording ------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    from kvlib.loaders.course_model import load_course_hybrid_model

    return load_course_hybrid_model()


def test_the_shipped_hybrid_has_the_documented_layout_and_caches_exactly(shipped):
    assert shipped.config == HYBRID_CONFIG
    assert shipped.num_parameters == hybrid().num_parameters
    prompt = token_ids(2, 60, seed=5)
    cached = generate(shipped, prompt, 48, cache=HybridCache.factory, prefill_chunk_size=20)
    assert torch.equal(cached, generate(shipped, prompt, 48, use_cache=False))


@pytest.mark.recorded
def test_recorded_hybrid_recall_is_reproduced(shipped):
    """CI recomputes points of `results/hybrid_recall.csv` (`python -m
    kvlib.experiments.hybrid_course_model`) from the shipped weights: recall at two distances,
    inside the window and far outside it, for the course model and the hybrid (within what
    another CPU's round-off can flip: 0.02 of the rate, 0.03 of an interval's end), and the cache
    bytes at two contexts (exact)."""
    import csv
    from pathlib import Path

    from kvlib.experiments.hybrid_course_model import cache_bytes_row, recall_rows
    from kvlib.loaders.course_model import load_course_model

    path = Path(__file__).resolve().parents[1] / "results" / "hybrid_recall.csv"
    with path.open() as f:
        rows = list(csv.DictReader(f))
    course = load_course_model()
    assert {r["model"]: int(r["parameters"]) for r in rows}["hybrid"] == shipped.num_parameters
    recorded = {(r["model"], r["distance"]): r for r in rows if r["measure"] == "recall"}
    models = {"course model": course, "hybrid": shipped}
    for fresh in recall_rows(models, distances=(8, 240)):
        row = recorded[(fresh["model"], str(fresh["distance"]))]
        assert int(row["facts"]) == fresh["facts"]
        assert abs(float(row["recall"]) - fresh["recall"]) <= 0.02, (row, fresh)
        ends = ("recall_low", "recall_high", "minus_course_low", "minus_course_high")
        for end in (*ends, "minus_hybrid_low", "minus_hybrid_high"):
            assert abs(float(row[end]) - fresh[end]) <= 0.03, (end, row, fresh)
    recorded = {(r["model"], r["context"]): r for r in rows if r["measure"] == "cache_bytes"}
    for name, model, context in (("hybrid", shipped, 1024), ("course model", course, 256)):
        fresh, row = cache_bytes_row(model, name, context), recorded[(name, str(context))]
        for column in ("cache_bytes", "equation_bytes", "full_bytes", "sliding_bytes"):
            assert int(row[column]) == fresh[column], (column, row, fresh)
