"""kvlib.model, kvlib.cache and kvlib.generation against oracles: cached == uncached for every
cache,
padded batch == each prompt alone, chunked == one-shot prefill, beam search == brute force, RoPE ==
its complex-number form, and checkpoints that round-trip or are refused clearly."""

import itertools
import json
import math

import numpy as np
import pytest
import torch

from kvlib.cache import DynamicCache, StaticCache
from kvlib.errors import CacheOverflowError, UnsupportedConfigError
from kvlib.generation import generate
from kvlib.layers.llama import apply_rope, rope_cos_sin, rope_inverse_frequencies
from kvlib.loaders.hf import load_hf_checkpoint, save_hf_checkpoint
from kvlib.model import LlamaModel, ModelConfig
from kvlib.ref import toy_cache
from kvlib.testing import assert_close

TINY = ModelConfig(
    vocab_size=48,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_model(
    config: ModelConfig = TINY, seed: int = 0, attention_backend: str = "reference"
) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(config, attention_backend=attention_backend).eval()
    with torch.no_grad():  # random norms too, so that a wrong layout cannot hide behind ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def prompts(batch=2, length=9, vocab=48, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA from one code path
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_logits_equal_uncached(kv_heads, cache):
    model = tiny_model(ModelConfig(**{**TINY.__dict__, "num_key_value_heads": kv_heads}))
    tokens = prompts(length=20)
    full = model(tokens)
    kv = DynamicCache(3) if cache == "dynamic" else StaticCache.for_model(model, 2, 20)
    pieces = [model(tokens[:, :12], cache=kv)] + [
        model(tokens[:, i : i + 1], cache=kv) for i in range(12, 20)
    ]
    assert_close(
        torch.cat(pieces, dim=1),
        full,
        name=f"cached ({cache}) vs uncached logits",
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "options",
    [{}, {"cache": "static"}, {"prefill_chunk_size": 4}, {"temperature": 0.8, "top_k": 5}],
)
def test_generate_cached_equals_naive(options):
    model = tiny_model()
    sampled = "temperature" in options
    out = generate(
        model,
        prompts(),
        12,
        generator=torch.Generator().manual_seed(3) if sampled else None,
        **options,
    )
    naive = generate(
        model,
        prompts(),
        12,
        use_cache=False,
        generator=torch.Generator().manual_seed(3) if sampled else None,
        **{k: v for k, v in options.items() if k != "cache"},
    )
    assert out.shape == (2, 21) and torch.equal(out[:, :9], prompts())
    assert torch.equal(out, naive), f"cached {out.tolist()} != naive {naive.tolist()}"


def test_padded_batch_equals_each_prompt_alone():
    model = tiny_model()
    lengths = [9, 4, 6]
    rows = [prompts(1, n, seed=10 + n)[0] for n in lengths]
    batch = torch.zeros(3, 9, dtype=torch.int64)
    mask = torch.zeros(3, 9, dtype=torch.int64)
    for i, row in enumerate(rows):
        batch[i, 9 - len(row) :], mask[i, 9 - len(row) :] = row, 1
    for options in ({}, {"cache": "static"}, {"use_cache": False}, {"prefill_chunk_size": 3}):
        together = generate(model, batch, 8, attention_mask=mask, **options)
        for i, row in enumerate(rows):
            alone = generate(model, row[None], 8)[0]
            assert torch.equal(together[i, 9 - len(row) :], alone), (
                f"prompt {i} ({options}): {together[i].tolist()} vs {alone.tolist()}"
            )


def test_chunked_prefill_equals_one_shot():
    model = tiny_model()
    tokens = prompts(length=23)
    one_shot = model(tokens)
    for chunk in (1, 5, 8, 23):
        cache = DynamicCache(3)
        chunks = [model(tokens[:, a : a + chunk], cache=cache) for a in range(0, 23, chunk)]
        assert_close(
            torch.cat(chunks, 1), one_shot, name=f"chunked prefill ({chunk})", rtol=1e-5, atol=1e-5
        )


def test_beam_search_equals_brute_force():
    config = ModelConfig(
        vocab_size=5,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = tiny_model(config, seed=4)
    prompt = torch.tensor([[1, 3, 2], [4, 0, 0]])
    steps = 3
    best = []
    for row in prompt:  # brute force: score all 5**3 continuations without a cache
        candidates = torch.tensor([list(c) for c in itertools.product(range(5), repeat=steps)])
        sequences = torch.cat([row.expand(len(candidates), -1), candidates], dim=1)
        logprobs = model(sequences).log_softmax(-1)
        scores = sum(
            logprobs[:, len(row) - 1 + i].gather(1, candidates[:, i : i + 1])[:, 0]
            for i in range(steps)
        )
        best.append(sequences[scores.argmax()])
    for options in ({}, {"cache": "static"}, {"use_cache": False}):
        # 25 = 5**2 beams: exhaustive
        beams = generate(model, prompt, steps, num_beams=25, **options)
        assert torch.equal(beams, torch.stack(best)), (
            f"{options}: {beams.tolist()} vs brute force {torch.stack(best).tolist()}"
        )
    assert torch.equal(
        generate(model, prompt, 4, num_beams=3),
        generate(model, prompt, 4, num_beams=3, use_cache=False),
    )


@pytest.mark.parametrize("cache", ["dynamic", "static", "paged"])
def test_parallel_sampling_prefills_once_and_samples_like_repeated_prompts(cache):
    model = tiny_model()
    ids = prompts(length=7)
    samples = generate(model, ids, 6, cache=cache, temperature=1.0, num_samples=3,
                       generator=torch.Generator().manual_seed(5))  # fmt: skip
    repeated = generate(model, ids.repeat_interleave(3, dim=0), 6, cache=cache, temperature=1.0,
                        generator=torch.Generator().manual_seed(5))  # fmt: skip
    assert samples.shape == (6, 13) and torch.equal(samples, repeated)
    assert len({tuple(row) for row in samples[:3, 7:].tolist()}) > 1  # the samples differ
    greedy = generate(model, ids, 6, cache=cache, num_samples=2)
    assert torch.equal(greedy, generate(model, ids, 6, cache=cache).repeat_interleave(2, dim=0))
    with pytest.raises(ValueError, match="num_samples: beam search returns one sequence"):
        generate(model, ids, 2, num_beams=2, num_samples=2)


def test_rope_matches_complex_rotation():
    x = torch.randn(1, 1, 5, 8)
    positions = torch.arange(3, 8)[None]
    cos, sin = rope_cos_sin(positions, 8, 100.0)
    rotated = apply_rope(x, cos, sin)
    pairs = torch.complex(x[..., :4], x[..., 4:])  # HF convention: dimension i pairs with i + D/2
    angles = positions[0, :, None].float() * 100.0 ** (-torch.arange(0, 8, 2).float() / 8)
    expected = pairs * torch.polar(torch.ones_like(angles), angles)
    assert_close(
        rotated,
        torch.cat([expected.real, expected.imag], -1),
        name="rotate_half RoPE",
        rtol=1e-5,
        atol=1e-6,
    )


def test_caches_validate_and_overflow():
    model = tiny_model()
    cache = StaticCache.for_model(model, 2, 10)
    model(prompts(length=8), cache=cache)
    with pytest.raises(
        CacheOverflowError, match="holds 10 tokens per sequence; writing 3 after 8 needs 11"
    ):
        model(prompts(length=3), cache=cache)
    # one class for chapter 1's and chapter 2's caches
    assert CacheOverflowError is toy_cache.CacheOverflowError
    k = torch.zeros(2, 2, 1, 16)
    with pytest.raises(ValueError, match=r"layer_idx: expected an int in \[0, 3\), got 3"):
        cache.update(3, k, k)
    with pytest.raises(TypeError, match="expected dtype torch.float32"):
        cache.update(0, k.half(), k.half())
    with pytest.raises(ValueError, match=r"\(B, H_kv, D\) = \(2, 2, 16\)"):
        cache.update(0, torch.zeros(3, 2, 1, 16), torch.zeros(3, 2, 1, 16))
    dynamic = DynamicCache(3)
    model(prompts(length=4), cache=dynamic)
    with pytest.raises(
        ValueError, match=r"expected \(B, H_kv, T, D\) with \(B, H_kv, D\) = \(2, 2, 16\)"
    ):
        dynamic.update(0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))


def test_cache_repeat_and_reorder():
    model = tiny_model()
    for cache in (DynamicCache(3), StaticCache.for_model(model, 2, 12)):
        model(prompts(length=5), cache=cache)
        bigger = cache.repeat(3)  # each prompt's prefill cloned into 3 decode rows
        next_tokens = torch.tensor([[7], [7], [7], [9], [9], [9]])
        logits = model(next_tokens, cache=bigger)
        assert_close(logits[0], logits[2], name="clones decode alike") and None
        alone = DynamicCache(3)
        model(prompts(length=5)[1:], cache=alone)
        assert_close(
            logits[3],
            model(torch.tensor([[9]]), cache=alone)[0],
            name="clone of prompt 1",
            rtol=1e-5,
            atol=1e-5,
        )


def test_repeat_keeps_the_cache_class():
    class Recording(DynamicCache):
        calls = 0

        def reorder(self, indices):
            Recording.calls += 1
            super().reorder(indices)

    model = tiny_model()
    generate(
        model,
        prompts(),
        4,
        num_beams=3,
        cache=lambda m, b, s: Recording(m.config.num_hidden_layers),
    )
    assert Recording.calls == 3  # one reorder per decode step after the first token
    model(prompts(length=4), cache=(static := StaticCache.for_model(model, 2, 8)))
    assert type(static.repeat(2)) is StaticCache and static.repeat(2).buffer.shape[2] == 4


def test_static_cache_allocates_once_dynamic_every_step():
    model = tiny_model()
    dynamic, static = DynamicCache(3), StaticCache.for_model(model, 2, 30)
    for cache in (dynamic, static):
        model(prompts(length=10), cache=cache)
        for _ in range(5):
            model(torch.tensor([[1], [2]]), cache=cache)
    assert static.allocations == 1 and dynamic.allocations == 5 * 2 * 3


def test_checkpoint_round_trip_tied_and_untied(tmp_path):
    for tied in (False, True):
        model = tiny_model(ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": tied}))
        save_hf_checkpoint(model, tmp_path / str(tied))
        loaded = load_hf_checkpoint(tmp_path / str(tied))
        assert_close(
            loaded(prompts()),
            model(prompts()),
            name=f"reloaded logits (tied={tied})",
            rtol=0,
            atol=0,
        )
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


def test_config_field_names_of_transformers_4_and_5(tmp_path):
    model = tiny_model()
    save_hf_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    theta = config.pop("rope_theta")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}  # transformers 5.x
    config["dtype"] = config.pop("torch_dtype")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_close(
        load_hf_checkpoint(tmp_path)(prompts()), model(prompts()), name="5.x config", rtol=0, atol=0
    )


@pytest.mark.parametrize(
    "change,message",
    [
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
        ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_checkpoints_are_refused(tmp_path, change, message):
    save_hf_checkpoint(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedConfigError, match=message):
        load_hf_checkpoint(tmp_path)


def test_checkpoint_shape_and_file_errors(tmp_path):
    save_hf_checkpoint(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.mlp.down_proj.weight has shape \(64, 96\), "
        r"the config implies \(64, 100\)",
    ):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_checkpoint(tmp_path / "missing")


def test_forward_and_generate_validate():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"input_ids: expected 1\+ ids in \[0, 48\)"):
        model(torch.tensor([[48]]))
    with pytest.raises(TypeError, match="input_ids: expected an int64"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 9\)"):
        generate(model, prompts(), 3, attention_mask=torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="cache: expected 'dynamic', 'static', 'paged' or a fac"):
        generate(model, prompts(), 3, cache="blocks")
    with pytest.raises(ValueError, match="block_size: expected an int >= 1, got 0"):
        generate(model, prompts(), 3, cache="paged", block_size=0)
    with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 1, got 0"):
        generate(model, prompts(), 0)


# Llama 3.1's rope_scaling, as its config.json gives it.
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def published_llama3_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's reference `apply_scaling` for Llama 3.1 as published: one frequency at a time."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
    return new_freqs


def test_llama3_rope_scaling_matches_the_published_formula():
    plain = rope_inverse_frequencies(128, 500000.0)
    scaled = rope_inverse_frequencies(128, 500000.0, LLAMA31_SCALING)
    expected = published_llama3_scaling(plain.tolist(), 8.0, 1.0, 4.0, 8192)
    assert_close(scaled, np.array(expected), name="llama3-scaled frequencies", rtol=1e-6, atol=0)
    wavelength = 2 * math.pi / plain
    kept, divided = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three regimes occur
    assert torch.equal(scaled[kept], plain[kept])
    assert_close(scaled[divided], plain[divided] / 8, name="long wavelengths", rtol=1e-6, atol=0)


def test_a_llama31_config_loads_with_its_rope_scaling(tmp_path):
    model = tiny_model()
    save_hf_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_scaling"] = dict(LLAMA31_SCALING, original_max_position_embeddings=16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.config.rope_scaling["factor"] == 8.0
    ids = prompts()
    plain_logits, scaled_logits = model(ids), loaded(ids)
    assert (plain_logits - scaled_logits).abs().max() > 1e-4  # scaling changes the angles
    cached = generate(loaded, ids[:1, :8], 8)
    assert torch.equal(cached, generate(loaded, ids[:1, :8], 8, use_cache=False))
    assert ModelConfig.from_hf(loaded.config.to_hf()).rope_scaling == loaded.config.rope_scaling
