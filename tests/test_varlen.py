"""The varlen paged prefill path (issue 36, part 3): `paged_prefill_attention` against attention
over each sequence's contiguous K/V, and the engine through `VarlenBatchKV`: every batching gives
each prompt's tokens generated alone, without building chapter 12's padded `BatchKV`."""

import pytest
import torch

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
