"""The varlen paged prefill path (issue 36, part 3): `paged_prefill_attention` against attention
over each sequence's contiguous K/V, and the engine through `VarlenBatchKV`: every batching gives
each prompt's tokens generated alone, without building chapter 12's padded `BatchKV`."""

import pytest
import torch

import kvlib.kernels  # noqa: F401  first: without CUDA it sets TRITON_INTERPRET before Triton loads
from kvlib.engine import LLMEngine, SamplingParams
from kvlib.engine import runner as runner_module
from kvlib.engine.varlen import VarlenBatchKV
from kvlib.ops.attention import reference_attention
from kvlib.ops.paged_prefill import paged_prefill_attention
from kvlib.quant import QuantScheme
from tests.test_engine import BATCHINGS, COURSE_PROMPTS, alone


def paged_inputs(seq_lens, query_lens, block_size=4, heads=4, kv_heads=2, dim=8, seed=0):
    """Pools holding each sequence's K/V in shuffled blocks, its contiguous K/V, and queries."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(widths) + 3, generator=g)  # 3 blocks nobody uses
    pool_shape = (len(order), block_size, kv_heads, dim)
    key_cache, value_cache = (
        torch.randn(pool_shape, generator=g),
        torch.randn(pool_shape, generator=g),
    )
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int64)
    used = 0
    for i, w in enumerate(widths):
        tables[i, :w] = order[used : used + w]
        used += w
    q = torch.randn(sum(query_lens), heads, dim, generator=g)
    return q, key_cache, value_cache, tables


def expected(q, key_cache, value_cache, tables, query_lens, seq_lens):
    out, start = [], 0
    for i, (t, s) in enumerate(zip(query_lens, seq_lens)):
        k = key_cache[tables[i]].flatten(0, 1)[:s].transpose(0, 1)[None]  # (1, H_kv, S, D)
        v = value_cache[tables[i]].flatten(0, 1)[:s].transpose(0, 1)[None]
        mask = torch.ones(s, s, dtype=torch.bool).tril()[s - t :]  # (T, S) causal, offset
        rows = q[start : start + t].transpose(0, 1)[None]
        out.append(reference_attention(rows, (k, v), mask[None])[0].transpose(0, 1))
        start += t
    return torch.cat(out)


CASES = {
    "prompts": ([5, 13, 8], [5, 13, 8]),
    "chunks after cached tokens": ([9, 30, 4], [3, 7, 4]),
    "decode rows": ([17, 1, 6], [1, 1, 1]),
    "mixed": ([23, 12, 16, 2], [1, 12, 5, 1]),
}


@pytest.mark.parametrize("name", CASES)
def test_paged_prefill_matches_attention_over_contiguous_kv(name):
    seq_lens, query_lens = CASES[name]
    q, key_cache, value_cache, tables = paged_inputs(seq_lens, query_lens)
    out = paged_prefill_attention(q, key_cache, value_cache, tables, query_lens, seq_lens)
    want = expected(q, key_cache, value_cache, tables, query_lens, seq_lens)
    assert torch.allclose(out, want, atol=1e-6, rtol=1e-5)
    # a sequence's rows depend on it alone: attended by itself, the same numbers
    start = 0
    for i, (t, s) in enumerate(zip(query_lens, seq_lens)):
        alone_out = paged_prefill_attention(
            q[start : start + t], key_cache, value_cache, tables[i : i + 1], [t], [s]
        )
        assert torch.equal(alone_out, out[start : start + t])
        start += t


def test_paged_prefill_dequantizes_per_token_scales():
    seq_lens, query_lens = [11, 6], [4, 6]
    q, key_cache, value_cache, tables = paged_inputs(seq_lens, query_lens)
    g = torch.Generator().manual_seed(1)
    codes_k = torch.randint(-127, 128, key_cache.shape, generator=g, dtype=torch.int8)
    codes_v = torch.randint(-127, 128, value_cache.shape, generator=g, dtype=torch.int8)
    k_scale = torch.rand(key_cache.shape[:3], generator=g) / 50
    v_scale = torch.rand(key_cache.shape[:3], generator=g) / 50
    out = paged_prefill_attention(
        q, codes_k, codes_v, tables, query_lens, seq_lens, k_scale=k_scale, v_scale=v_scale
    )
    dequantized = [c.float() * s[..., None] for c, s in ((codes_k, k_scale), (codes_v, v_scale))]
    want = expected(q, *dequantized, tables, query_lens, seq_lens)
    assert torch.allclose(out, want, atol=1e-6, rtol=1e-5)


def test_paged_prefill_rejects_lengths_that_do_not_fit():
    q, key_cache, value_cache, tables = paged_inputs([5, 6], [5, 6])
    with pytest.raises(ValueError, match="query_lens"):
        paged_prefill_attention(q, key_cache, value_cache, tables, [5, 5], [5, 6])
    with pytest.raises(ValueError, match="seq_len"):
        paged_prefill_attention(q[:9], key_cache, value_cache, tables, [5, 4], [5, 3])
    with pytest.raises(ValueError, match="k_scale"):
        paged_prefill_attention(
            q, key_cache, value_cache, tables, [5, 6], [5, 6], k_scale=key_cache[..., 0]
        )


# --- the fused Triton kernel (issue 48, part 3), under the interpreter on a CPU ---------------


def kernel_inputs(seq_lens, query_lens, dtype=torch.float32, **shape):
    """`paged_inputs` in the kernel's convention: int32 tables, cu_seqlens_q and seq_lens."""
    q, key_cache, value_cache, tables = paged_inputs(seq_lens, query_lens, **shape)
    cu_seqlens = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables.int(), cu_seqlens, lens


KERNEL_SHAPES = {
    "blocks of 4, D = 8": dict(block_size=4, heads=4, kv_heads=2, dim=8),
    "blocks of 16, D = 24, MQA": dict(block_size=16, heads=3, kv_heads=1, dim=24),
}


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("name", CASES)
def test_the_fused_kernel_matches_the_reference(name, shape):
    pytest.importorskip("triton")
    from kvlib.ops.varlen_attention import varlen_paged_attention, varlen_paged_attention_ref

    seq_lens, query_lens = CASES[name]
    inputs = kernel_inputs(seq_lens, query_lens, **KERNEL_SHAPES[shape])
    want = varlen_paged_attention_ref(*inputs, max_query_len=max(query_lens))
    got = varlen_paged_attention(*inputs, max_query_len=max(query_lens))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    # a grid sized for more queries than any sequence has (what a captured graph launches)
    padded = varlen_paged_attention(*inputs, max_query_len=max(query_lens) + 40)
    assert torch.equal(padded, got)


def test_the_fused_kernel_reads_bf16_and_quantized_pools():
    pytest.importorskip("triton")
    from kvlib.ops.varlen_attention import varlen_paged_attention, varlen_paged_attention_ref

    seq_lens, query_lens = [23, 12, 40], [1, 12, 17]
    bf16 = kernel_inputs(seq_lens, query_lens, torch.bfloat16, block_size=16, dim=16)
    diff = (
        varlen_paged_attention(*bf16, max_query_len=17)
        - varlen_paged_attention_ref(*bf16, max_query_len=17)
    ).abs()
    assert diff.max() <= 2e-2, diff.max()  # bf16 outputs: a rounding step apart at most
    q, key_cache, value_cache, tables, cu_seqlens, lens = kernel_inputs(seq_lens, query_lens)
    g = torch.Generator().manual_seed(2)
    codes = [torch.randint(-127, 128, key_cache.shape, generator=g, dtype=torch.int8) for _ in "kv"]
    scales = [torch.rand(key_cache.shape[:3], generator=g) / 50 for _ in "kv"]
    args = (q, *codes, tables, cu_seqlens, lens)
    kwargs = dict(max_query_len=17, k_scale=scales[0], v_scale=scales[1])
    got, want = varlen_paged_attention(*args, **kwargs), varlen_paged_attention_ref(*args, **kwargs)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_the_fused_kernel_names_bad_inputs():
    pytest.importorskip("triton")
    from kvlib.ops.varlen_attention import varlen_paged_attention

    q, key_cache, value_cache, tables, cu_seqlens, lens = kernel_inputs([5, 6], [5, 6])
    with pytest.raises(ValueError, match="int32"):
        varlen_paged_attention(q, key_cache, value_cache, tables.long(), cu_seqlens, lens,
                               max_query_len=6)  # fmt: skip
    with pytest.raises(ValueError, match="n \\+ 1"):
        varlen_paged_attention(q, key_cache, value_cache, tables, cu_seqlens[:2], lens,
                               max_query_len=6)  # fmt: skip
    with pytest.raises(ValueError, match="max_query_len"):
        varlen_paged_attention(q, key_cache, value_cache, tables, cu_seqlens, lens,
                               max_query_len=0)  # fmt: skip
    with pytest.raises(TypeError, match="one dtype"):
        varlen_paged_attention(q.double(), key_cache, value_cache, tables, cu_seqlens, lens,
                               max_query_len=6)  # fmt: skip


@pytest.fixture(scope="module")
def course():
    from kvlib.loaders.course_model import load_course_model

    return load_course_model()


def varlen_engine(model, monkeypatch, **options):
    """An engine whose steps all go through `VarlenBatchKV` (the decode kernel off): building
    chapter 12's padded `BatchKV` fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the varlen path built a padded BatchKV")

    monkeypatch.setattr(runner_module.BatchKV, "__init__", refuse)
    engine = LLMEngine(model, **options)
    engine.runner.prefill_varlen, engine.runner.decode_kernel = True, False
    built = []
    original = engine.runner._batch_kv

    def spy(batch):
        kv = original(batch)
        built.append(type(kv))
        return kv

    engine.runner._batch_kv = spy
    return engine, built


@pytest.mark.parametrize("name", BATCHINGS)
def test_varlen_engine_output_is_independent_of_batching(course, monkeypatch, name):
    options, exercised = BATCHINGS[name]
    engine, built = varlen_engine(course, monkeypatch, **options)
    outputs = engine.generate(COURSE_PROMPTS, SamplingParams(max_tokens=24), use_tqdm=False)
    assert [o.output_token_ids for o in outputs] == alone(course, COURSE_PROMPTS, 24)
    assert set(built) == {VarlenBatchKV}
    summary = engine.summary()
    for key, least in exercised.items():
        assert summary[key] >= least, (key, summary[key])


def test_varlen_engine_quantized_cache_matches_the_default_path(course, monkeypatch):
    options = dict(num_blocks=20, max_num_batched_tokens=16, kv_scheme=QuantScheme("int8"))
    params = SamplingParams(max_tokens=16)
    reference = LLMEngine(course, **options).generate(COURSE_PROMPTS, params, use_tqdm=False)
    engine, built = varlen_engine(course, monkeypatch, **options)
    outputs = engine.generate(COURSE_PROMPTS, params, use_tqdm=False)
    assert engine.summary()["preemptions"] >= 1 and set(built) == {VarlenBatchKV}
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in reference]


def test_varlen_is_chosen_only_where_it_fits(course):
    engine = LLMEngine(course, num_blocks=20)
    assert engine.runner.prefill_varlen is False  # the default: BatchKV's padded batch
    assert not engine.runner._use_varlen()
    grouped = LLMEngine(course, num_blocks=20, kv_scheme=QuantScheme("int4", group_size=8))
    grouped.runner.prefill_varlen = True
    assert not grouped.runner._use_varlen()  # packed codes, grouped scales: BatchKV's path


def test_the_engine_attends_prefill_rows_through_the_fused_kernel(course, monkeypatch):
    """`prefill_kernel=True` on a CPU runs the kernel under the interpreter: every row (the
    decode kernel off) through one launch per layer, the tokens of each prompt alone."""
    pytest.importorskip("triton")
    from kvlib.ops import varlen_attention

    launches = []
    original = varlen_attention.varlen_paged_attention

    def spy(q, *args, **kwargs):
        launches.append((q.shape[0], args[4].shape[0] - 1))  # (rows, sequences)
        return original(q, *args, **kwargs)

    monkeypatch.setattr(varlen_attention, "varlen_paged_attention", spy)
    prompts = COURSE_PROMPTS[:3]
    engine = LLMEngine(course, num_blocks=40, max_num_batched_tokens=32)
    engine.runner.prefill_varlen, engine.runner.decode_kernel = True, False
    engine.runner.prefill_kernel = True
    outputs = engine.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert [o.output_token_ids for o in outputs] == alone(course, prompts, 4)
    layers = course.config.num_hidden_layers
    assert len(launches) == layers * len(engine.stats)  # one launch per layer and step
    assert max(sequences for _, sequences in launches) >= 2  # several sequences per launch
