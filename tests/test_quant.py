"""kvlib.quant and the quantized caches: every scheme against a float64 restatement with its error
bound; packing; byte accounting; the caches under the cache interface (dense with a residual,
paged, transformers' re-quantization); the quantized decode kernel; the committed sweep,
spot-checked."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib.memory as memory
from kvlib.cache import DynamicCache, QuantizedCache, QuantizedPagedCache
from kvlib.experiments.quant_sweep import quant_factory
from kvlib.generation import generate
from kvlib.metrics.quality import course_text
from kvlib.quant import (
    FORMATS,
    QuantScheme,
    _expand,
    _grouped,
    _squeeze_shape,
    cat_quantized,
    dequantize,
    pack_bits,
    quantize,
    round_trip_bound,
    unpack_bits,
)
from tests.sweeps import spot_check_recall, spot_check_smollm2
from tests.test_model import TINY, prompts, tiny_model

RESULTS = Path(__file__).parent.parent / "results" / "quant_sweep.csv"

SCHEMES = [
    QuantScheme(fmt, symmetric, reduce, group)
    for fmt in FORMATS
    for symmetric in ((True,) if fmt.startswith("fp8") else (True, False))
    for reduce, group in (
        ("channels", None),
        ("channels", 8),
        ("tokens", None),
        ("tokens", 4),
        ("all", None),
    )
]


def _levels(q):
    """The integer levels of q's codes (signed for symmetric schemes), int64."""
    fmt = q.scheme.fmt
    if fmt.bits == 8:
        return q.codes.long()
    levels = unpack_bits(q.codes, fmt.bits).long()
    return levels - 2 ** (fmt.bits - 1) if q.scheme.symmetric else levels


def _sample(seed=0, shape=(2, 3, 16, 32)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    x[..., 5] *= 30  # an outlier channel, as real keys have
    return x


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label())
def test_every_scheme_against_a_float64_reference(scheme):
    x = _sample()
    q = quantize(x, scheme)
    x_hat = dequantize(q, torch.float64)
    fmt = scheme.fmt
    scale = q.scale.double()
    # the stored scale bounds the group's range from above, by less than one scale-dtype step
    grouped_abs = x.double().abs() if scheme.symmetric else None
    if scheme.symmetric:
        qmax = fmt.max if fmt.is_float else 2 ** (fmt.bits - 1) - 1
        need = _reduce_max(grouped_abs, scheme) / qmax
    else:
        assert (q.zero.double() <= _reduce_min(x.double(), scheme)).all()
        need = (_reduce_max(x.double(), scheme) - q.zero.double()) / (2**fmt.bits - 1)
    nonzero = need > 0
    assert (scale[nonzero] >= need[nonzero]).all()
    step = 2.0**-24  # float16 subnormal spacing: e5m2 scales (max|x| / 57344) can be that small
    assert (scale[nonzero] <= need[nonzero] * (1 + 2**-9) + step).all()
    # codes: what a float64 restatement of the formula gives, with the stored scale and zero
    s = _expand(scale, x.shape, scheme)
    z = 0 if q.zero is None else _expand(q.zero.double(), x.shape, scheme)
    exact = (x.double() - z) / s
    if fmt.is_float:
        reference = exact.to(fmt.dtype).double()
        got = q.codes.double()
    else:
        reference = exact.round()
        got = _levels(q).double()
    near_tie = (exact - exact.floor() - 0.5).abs() < 1e-4  # fp32 vs fp64 rounding may differ
    agree = (got == reference) | near_tie
    assert agree.all(), f"{(~agree).sum()} codes differ from the float64 reference"
    # the round trip is within the stated bound, element by element
    error = (x.double() - x_hat).abs()
    assert (error <= round_trip_bound(q, x)).all()
    # and the bound is not vacuous: some element uses at least a quarter of it
    assert float((error / round_trip_bound(q, x)).max()) > 0.25


def _reduce_max(t, scheme):
    grouped, dims = _grouped(t, scheme)
    return grouped.amax(dim=dims, keepdim=True).reshape(_squeeze_shape(t.shape, scheme))


def _reduce_min(t, scheme):
    grouped, dims = _grouped(t, scheme)
    return grouped.amin(dim=dims, keepdim=True).reshape(_squeeze_shape(t.shape, scheme))


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    symmetric=st.booleans(),
    reduce=st.sampled_from(["channels", "tokens", "all"]),
    tokens=st.integers(1, 6),
    constant=st.booleans(),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 10_000),
)
def test_round_trip_property(fmt, symmetric, reduce, tokens, constant, magnitude, seed):
    if fmt.startswith("fp8"):
        symmetric = True
    scheme = QuantScheme(fmt, symmetric, reduce)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, 8, generator=g) * magnitude
    if constant:  # max == min in every group: scale 0 would divide 0 by 0 (a float16 value)
        x = torch.full_like(x, float(x[0, 0, 0].half()))
    q = quantize(x, scheme)
    x_hat = q.dequantize()
    assert torch.isfinite(x_hat).all()
    assert ((x.double() - x_hat.double()).abs() <= round_trip_bound(q, x)).all()
    if constant and not symmetric:
        assert torch.equal(x_hat, x)  # every code 0, x̂ = z exactly


def test_pack_bits_round_trip_and_errors():
    g = torch.Generator().manual_seed(0)
    for bits in (2, 4):
        levels = torch.randint(0, 2**bits, (3, 5, 16), generator=g)
        packed = pack_bits(levels, bits)
        assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 16 * bits // 8)
        assert torch.equal(unpack_bits(packed, bits).long(), levels)
    assert pack_bits(torch.tensor([1, 2]), 4).tolist() == [0x21]  # first element, low nibble
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.tensor([1, 2]), 3)
    with pytest.raises(ValueError, match="multiple of 2"):
        pack_bits(torch.tensor([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="out of range"):
        pack_bits(torch.tensor([1, 16]), 4)


def test_scheme_and_quantize_errors_name_the_argument():
    with pytest.raises(ValueError, match="format"):
        QuantScheme("int3")
    with pytest.raises(ValueError, match="reduce"):
        QuantScheme("int8", reduce="heads")
    with pytest.raises(ValueError, match="symmetric"):
        QuantScheme("fp8_e4m3fn", symmetric=False)
    with pytest.raises(ValueError, match="group_size"):
        QuantScheme("int8", reduce="all", group_size=4)
    with pytest.raises(TypeError, match="scale_dtype"):
        QuantScheme("int8", scale_dtype=torch.int8)
    x = torch.randn(2, 6, 10)
    with pytest.raises(ValueError, match="group_size"):
        quantize(x, QuantScheme("int8", reduce="channels", group_size=4))
    with pytest.raises(ValueError, match="packs 4 codes"):
        quantize(x, QuantScheme("int2"))
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.tensor([[1.0, float("nan")]]), QuantScheme("int8"))
    with pytest.raises(ValueError, match="overflows"):
        quantize(torch.tensor([[1e9, 1.0]]), QuantScheme("int8"))
    with pytest.raises(ValueError, match="x: expected"):
        quantize(torch.ones(4, dtype=torch.int64), QuantScheme("int8"))


def test_fp8_formats_have_their_own_range():
    assert FORMATS["fp8_e4m3fn"].max == 448 and FORMATS["fp8_e4m3fnuz"].max == 240
    assert FORMATS["fp8_e5m2"].max == 57344
    x = torch.linspace(-1, 1, 64).reshape(2, 32) * 1000
    for fmt in ("fp8_e4m3fn", "fp8_e4m3fnuz"):  # scaled to each format's own max: no NaN
        assert torch.isfinite(quantize(x, QuantScheme(fmt)).dequantize()).all()
    # scaled for 448 but stored as fnuz (max 240): the values above 240 become NaN
    assert torch.isnan((x / (1000 / 448)).to(torch.float8_e4m3fnuz).float()).any()


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label())
def test_bytes_counted_match_bytes_stored(scheme):
    x = _sample(shape=(2, 3, 16, 32))
    q = quantize(x, scheme)
    vectors = 2 * 3 * 16
    expected = vectors * scheme.bytes_per_vector(32)
    if scheme.reduce == "all" or (scheme.reduce == "tokens" and scheme.group_size is None):
        # scales shared by a whole axis: bytes_per_vector counts them as 0 per token
        expected += q.scale.numel() * q.scale.element_size() * (1 if scheme.symmetric else 2)
    assert q.nbytes == expected


def test_quantized_bytes_in_the_memory_equation():
    config = memory.shipped_configs()["llama-3-8b"]
    int8 = QuantScheme("int8")  # 128 one-byte codes + one fp16 scale per vector
    per_token = 32 * 8 * 2 * (128 + 2)
    assert memory.quantized_kv_cache_bytes(config, 4096, int8) == 4096 * per_token
    kivi2 = (QuantScheme("int2", False, "tokens", 32), QuantScheme("int2", False, "channels", 32))
    # 2-bit codes: 32 bytes per 128-vector; 128 / 32 = 4 (scale, zero) fp16 pairs: 16 bytes
    per_token = 32 * 8 * 2 * (32 + 16)
    assert memory.quantized_kv_cache_bytes(config, 4096, *kivi2) == 4096 * per_token
    fp16 = memory.kv_cache_bytes(config, 4096, 1, "float16")
    budget = memory.memory_budget(
        config, 80 * 2**30, 4096, weight_bytes=16 * 10**9, kv_schemes=(int8, int8)
    )
    plain = memory.memory_budget(config, 80 * 2**30, 4096, weight_bytes=16 * 10**9)
    assert plain.bytes_per_sequence == fp16
    assert budget.bytes_per_sequence == memory.quantized_kv_cache_bytes(config, 4096, int8)
    assert budget.max_sequences > plain.max_sequences
    with pytest.raises(Exception, match="mla"):
        memory.quantized_kv_cache_bytes(memory.shipped_configs()["deepseek-v3"], 16, int8)


# --- the caches ---------------------------------------------------------------------------


def test_residual_longer_than_the_text_is_the_full_cache_bitwise():
    model, ids = tiny_model(), prompts(2, 9)
    full = generate(model, ids, 8)
    factory = QuantizedCache.factory(QuantScheme("int2", False), residual_length=64)
    assert torch.equal(generate(model, ids, 8, cache=factory), full)


def test_kivi_cache_keeps_R_exact_and_quantizes_whole_groups():
    model = tiny_model()
    key = QuantScheme("int4", False, "tokens", 4)
    value = QuantScheme("int4", False, "channels", 8)
    cache = QuantizedCache(TINY.num_hidden_layers, key, value, residual_length=3)
    reference = DynamicCache(TINY.num_hidden_layers)
    ids = prompts(2, 23)
    model(ids[:, :5], cache=cache)
    model(ids[:, :5], cache=reference)
    for t in range(5, 23):  # one token at a time: the groups fill as they would in decoding
        model(ids[:, t : t + 1], cache=cache)
        model(ids[:, t : t + 1], cache=reference)
        n = cache.length
        for layer in range(TINY.num_hidden_layers):
            kept_k = cache.residual_keys[layer].shape[2]
            assert 3 <= kept_k < 3 + 4 or n < 3 + 4  # R <= residual < R + G
            assert cache.residual_values[layer].shape[2] == min(3, n)
            history = cache.keys[layer]
            if history is not None:
                assert history.num_tokens % 4 == 0 and history.num_tokens + kept_k == n
    # the history is what quantizing the same keys group by group gives (streaming == batch),
    # but keys differ from the full cache's after the first quantized layer, so compare layer 0
    k0 = reference.keys[0][:, :, : cache.keys[0].num_tokens]
    assert torch.equal(cache.keys[0].codes, quantize(k0, key).codes)
    torch.testing.assert_close(
        cache.residual_keys[0], reference.keys[0][:, :, -cache.residual_keys[0].shape[2] :]
    )


def test_key_flush_unit_cache_holds_per_token_keys_back_in_whole_units():
    """chapter 10's control (`kvlib.experiments.quant_flush_unit`): per-token keys leave the
    residual in units of G tokens, as KIVI's per-channel keys do; values as before; a unit of 1
    is `QuantizedCache` bitwise."""
    from kvlib.experiments.quant_flush_unit import KeyFlushUnitCache

    model, ids = tiny_model(), prompts(2, 23)
    key, value = QuantScheme("int4", False), QuantScheme("int4", False, "channels", 8)
    cache = KeyFlushUnitCache(
        TINY.num_hidden_layers, key, value, key_flush_unit=4, residual_length=3
    )
    reference = DynamicCache(TINY.num_hidden_layers)
    for t in range(23):
        model(ids[:, t : t + 1], cache=cache)
        model(ids[:, t : t + 1], cache=reference)
        n = cache.length
        for layer in range(TINY.num_hidden_layers):
            kept_k = cache.residual_keys[layer].shape[2]
            assert kept_k == n if n < 3 + 4 else 3 <= kept_k < 3 + 4  # R <= residual < R + unit
            assert cache.residual_values[layer].shape[2] == min(3, n)
    k0 = reference.keys[0][:, :, : cache.keys[0].num_tokens]  # per token: row by row
    assert cache.keys[0].num_tokens % 4 == 0 and torch.equal(
        cache.keys[0].codes, quantize(k0, key).codes
    )
    one = KeyFlushUnitCache.factory(key, value, key_flush_unit=1, residual_length=2)
    plain = QuantizedCache.factory(key, value, residual_length=2)
    assert torch.equal(generate(model, ids, 6, cache=one), generate(model, ids, 6, cache=plain))
    with pytest.raises(ValueError, match="key_scheme: expected per-token keys"):
        KeyFlushUnitCache(2, QuantScheme("int4", False, "tokens", 4), key_flush_unit=4)
    with pytest.raises(ValueError, match="key_flush_unit"):
        KeyFlushUnitCache(2, key, key_flush_unit=0)


def test_int8_cache_close_to_the_full_cache_and_generates():
    model, ids = tiny_model(), prompts(2, 12)
    full = model(ids)
    for scheme in (QuantScheme("int8"), QuantScheme("fp8_e4m3fn")):
        cache = QuantizedCache(TINY.num_hidden_layers, scheme)
        logits = torch.cat([model(ids[:, :6], cache=cache), model(ids[:, 6:], cache=cache)], 1)
        torch.testing.assert_close(logits, full, rtol=0, atol=0.05)
    out = generate(model, ids, 6, cache=QuantizedCache.factory(QuantScheme("int8")), num_beams=2)
    assert out.shape == (2, 18)
    samples = generate(
        model,
        ids,
        4,
        cache=QuantizedCache.factory(QuantScheme("int4", False)),
        num_samples=3,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    assert samples.shape == (6, 16)


def test_paged_quantized_cache_equals_the_dense_one_with_padding_beams_and_samples():
    model = tiny_model()
    ids = prompts(3, 10)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: per-token scales make pad tokens harmless
    scheme = QuantScheme("int8")

    paged = QuantizedPagedCache.factory(block_size=4, copies_per_sequence=4, key_scheme=scheme)
    dense = QuantizedCache.factory(scheme)
    for options in ({}, {"num_beams": 2}):
        a = generate(model, ids, 7, attention_mask=mask, cache=paged, **options)
        b = generate(model, ids, 7, attention_mask=mask, cache=dense, **options)
        assert torch.equal(a, b), options
    asym = QuantScheme("int4", False, "channels", 8)
    paged_asym = QuantizedPagedCache.factory(block_size=4, copies_per_sequence=4, key_scheme=asym)

    kwargs = {"num_samples": 2, "temperature": 1.0}
    a = generate(
        model, ids, 5, cache=paged_asym, generator=torch.Generator().manual_seed(1), **kwargs
    )
    b = generate(
        model,
        ids,
        5,
        cache=QuantizedCache.factory(asym),
        generator=torch.Generator().manual_seed(1),
        **kwargs,
    )
    assert torch.equal(a, b)


def test_cache_errors_name_the_argument():
    with pytest.raises(ValueError, match="key_scheme: a per-tensor"):
        QuantizedCache(2, QuantScheme("int8", reduce="all"))
    with pytest.raises(ValueError, match="group_size G"):
        QuantizedCache(2, QuantScheme("int8", reduce="tokens"))
    with pytest.raises(TypeError, match="value_scheme"):
        QuantizedCache(2, QuantScheme("int8"), "int8")
    with pytest.raises(ValueError, match="residual_length"):
        QuantizedCache(2, QuantScheme("int8"), residual_length=-1)
    with pytest.raises(ValueError, match="per token"):
        QuantizedPagedCache(
            2, 2, 8, num_blocks=4, key_scheme=QuantScheme("int4", False, "tokens", 4)
        )
    cache = QuantizedCache(2, QuantScheme("int8"))
    with pytest.raises(ValueError, match="layer_idx"):
        cache.update(2, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))


def test_requantizing_the_history_costs_O_n_and_accumulates_error():
    torch.manual_seed(0)
    scheme = QuantScheme("int4", False, "tokens", 8)
    k = torch.randn(1, 2, 96, 16)
    k[..., 3] *= 10
    kivi = QuantizedCache(1, scheme, residual_length=8)
    transformers_like = QuantizedCache(1, scheme, residual_length=8, requantize_history=True)
    for t in range(96):
        for cache in (kivi, transformers_like):
            cache.update(0, k[:, :, t : t + 1], k[:, :, t : t + 1])
            cache.advance(1)
    # each flush re-quantizes everything held: quadratic in total, kivi's is linear
    assert transformers_like.requantized_tokens > 5 * 2 * 96
    first = slice(0, 16)  # the oldest tokens have been re-rounded at every flush

    def error(cache):
        keys = torch.cat([dequantize(cache.keys[0]), cache.residual_keys[0]], dim=2)
        return float((keys - k)[:, :, first].abs().mean())

    assert error(transformers_like) > 1.5 * error(kivi)


# --- the kernel ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3fn", "fp8_e5m2"])
def test_quantized_decode_kernel_matches_its_reference(fmt):
    from kvlib.cache.block_table import shuffled_block_tables
    from kvlib.kernels import paged_decode_attention, paged_decode_attention_ref

    g = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([5, 40, 77], dtype=torch.int32)
    block_tables, num_blocks = shuffled_block_tables(seq_lens, 16, generator=g)
    k = torch.randn(num_blocks, 16, 2, 32, generator=g)
    v = torch.randn(num_blocks, 16, 2, 32, generator=g)
    q = torch.randn(3, 8, 32, generator=g)
    qk, qv = quantize(k, QuantScheme(fmt)), quantize(v, QuantScheme(fmt))
    scales = {"k_scale": qk.scale[..., 0].contiguous(), "v_scale": qv.scale[..., 0].contiguous()}
    out = paged_decode_attention(
        q, qk.codes, qv.codes, block_tables, seq_lens, num_splits=2, **scales
    )
    ref = paged_decode_attention_ref(q, qk.codes, qv.codes, block_tables, seq_lens, **scales)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the reference is attention over the dequantized cache
    dense = paged_decode_attention_ref(q, qk.dequantize(), qv.dequantize(), block_tables, seq_lens)
    torch.testing.assert_close(ref, dense, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="both"):
        paged_decode_attention(
            q, qk.codes, qv.codes, block_tables, seq_lens, k_scale=scales["k_scale"]
        )
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(
            q, qk.codes, qv.codes, block_tables, seq_lens, k_scale=qk.scale, v_scale=qv.scale
        )
    with pytest.raises(TypeError, match="codes"):
        paged_decode_attention(q, k, v, block_tables, seq_lens, **scales)


def test_kernel_reads_the_paged_quantized_cache():
    from kvlib.kernels import paged_decode_attention

    model = tiny_model()
    ids = prompts(2, 11)
    cache = QuantizedPagedCache.for_model(
        model, 2, 16, block_size=16, key_scheme=QuantScheme("fp8_e4m3fn")
    )
    model(ids[:, :10], cache=cache)
    q = torch.randn(2, TINY.num_attention_heads, TINY.head_dim)
    seen = []
    original = cache.attention_backend

    def spy(q, kv, mask, **kw):
        seen.append(kv)
        return original(q, kv, mask, **kw)

    cache.attention_backend = spy
    model(ids[:, 10:], cache=cache)
    kv = seen[0]
    out = paged_decode_attention(
        q,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables.int(),
        kv.seq_lens.int(),
        k_scale=kv.key_scale[..., 0].contiguous(),
        v_scale=kv.value_scale[..., 0].contiguous(),
    )
    mask = torch.ones(2, 1, 11, dtype=torch.bool)
    ref = original(q[:, :, None], kv, mask)[:, :, 0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# --- SmolLM2 and the committed sweep ------------------------------------------------------


@pytest.mark.slow
def test_smollm2_generates_on_quantized_caches(smollm2):
    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer.encode(course_text()[:400])])
    full = generate(model, ids, 12)
    int8 = generate(model, ids, 12, cache=quant_factory("int8 per-token"))
    assert torch.equal(int8, full)

    paged = QuantizedPagedCache.factory(key_scheme=QuantScheme("int8"))
    assert torch.equal(generate(model, ids, 12, cache=paged), int8)
    kivi = generate(model, ids, 12, cache=quant_factory("int4 KIVI", 32))
    assert kivi.shape == full.shape


@pytest.mark.recorded
def test_recorded_sweep_spot_check_recall():
    spot_check_recall(RESULTS, "int2 KIVI", 32, quant_factory("int2 KIVI", 32))


@pytest.mark.recorded
@pytest.mark.slow
def test_recorded_sweep_spot_check_smollm2(smollm2):
    spot_check_smollm2(
        RESULTS,
        smollm2,
        text=("int4 KIVI", 0, quant_factory("int4 KIVI")),
        passkey=("int2 per-token", 0, quant_factory("int2 per-token")),
    )


@pytest.mark.recorded
@pytest.mark.slow
def test_recorded_flush_unit_control_spot_check(smollm2):
    from kvlib.experiments.quant_flush_unit import FLUSH_UNIT_LABELS, flush_unit_factory

    label = FLUSH_UNIT_LABELS[0]
    path = RESULTS.with_name("quant_flush_unit.csv")
    spot_check_smollm2(path, smollm2, text=(label, 0, flush_unit_factory(label)))


def test_cat_quantized_refuses_mixed_parts():
    a = quantize(torch.randn(1, 4, 8), QuantScheme("int8"))
    b = quantize(torch.randn(1, 4, 8), QuantScheme("int4", False))
    with pytest.raises(ValueError, match="one scheme"):
        cat_quantized([a, b])
    with pytest.raises(ValueError, match="per-tensor"):
        cat_quantized([quantize(torch.randn(1, 4, 8), QuantScheme("int8", reduce="all"))] * 2)
    assert cat_quantized([a, a]).num_tokens == 8
    assert math.isclose(dequantize(cat_quantized([a, a]))[:, 4:].sum(), dequantize(a).sum())
