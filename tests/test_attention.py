"""kvlib.ref (attention, the toy decoder and its cache) against independent oracles: PyTorch
SDPA, explicit loops, full recompute."""

import numpy as np
import pytest
import torch

from kvlib._validate import check_shape
from kvlib.course.bench import interleaved_times_ms, loglog_slope
from kvlib.errors import CacheOverflowError
from kvlib.memory.formula import dense_kv_cache_bytes
from kvlib.ref import attention as A
from kvlib.ref.toy_cache import ToyKVCache
from kvlib.ref.toy_generation import generate_cached, generate_naive
from kvlib.ref.toy_model import ToyConfig, ToyModel
from kvlib.testing import assert_close


def test_softmax_matches_definition_and_survives_large_inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5))
    assert_close(A.softmax(x), np.exp(x) / np.exp(x).sum(-1, keepdims=True), name="softmax")
    big = np.array([1000.0, 1001.0, 1002.0])
    expected = np.exp([-2.0, -1.0, 0.0]) / np.exp([-2.0, -1.0, 0.0]).sum()
    assert_close(A.softmax(big), expected, name="softmax of large inputs")
    assert_close(A.softmax(x + 123.0), A.softmax(x), name="softmax is shift-invariant")
    assert_close(A.softmax(x, axis=0).sum(axis=0), np.ones(5), name="softmax over axis 0")


def test_softmax_masked_entries_and_errors():
    assert_close(
        A.softmax(np.array([0.0, -np.inf, 0.0])), np.array([0.5, 0.0, 0.5]), name="masked softmax"
    )
    with pytest.raises(ValueError, match="entirely -inf"):
        A.softmax(np.array([[0.0, 1.0], [-np.inf, -np.inf]]))
    with pytest.raises(TypeError, match="x: expected a numpy array, got list"):
        A.softmax([1.0, 2.0])
    with pytest.raises(TypeError, match="x: expected a floating-point dtype, got int64"):
        A.softmax(np.array([1, 2]))


def test_causal_mask_cases():
    assert np.array_equal(A.causal_mask(4, 4), np.tril(np.ones((4, 4), dtype=bool)))
    assert np.array_equal(A.causal_mask(1, 6), np.ones((1, 6), dtype=bool))
    chunk = A.causal_mask(2, 5)  # 3 cached, then 2 new tokens
    assert np.array_equal(chunk, np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=bool))
    with pytest.raises(ValueError, match=r"num_queries: expected <= num_keys \(3\), got 4"):
        A.causal_mask(4, 3)
    with pytest.raises(ValueError, match="num_keys: expected an int >= 1, got 0"):
        A.causal_mask(1, 0)


@pytest.mark.parametrize("num_queries,num_keys", [(7, 7), (1, 9), (3, 11)])
def test_attention_matches_torch_sdpa(num_queries, num_keys):
    rng = np.random.default_rng(num_keys)
    q = rng.normal(size=(2, 3, num_queries, 8))
    k = rng.normal(size=(2, 3, num_keys, 8))
    v = rng.normal(size=(2, 3, num_keys, 5))
    mask = A.causal_mask(num_queries, num_keys)
    ours = A.attention(q, k, v, mask)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q),
        torch.from_numpy(k),
        torch.from_numpy(v),
        attn_mask=torch.from_numpy(mask),
    )
    assert_close(ours, theirs, name="attention vs torch SDPA", rtol=1e-10, atol=1e-12)


def test_attention_matches_explicit_loop():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(4, 6)), rng.normal(size=(9, 6)), rng.normal(size=(9, 3))
    mask = A.causal_mask(4, 9)
    expected = np.zeros((4, 3))
    for i in range(4):
        visible = [j for j in range(9) if mask[i, j]]
        scores = np.array([q[i] @ k[j] / np.sqrt(6) for j in visible])
        weights = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
        expected[i] = sum(w * v[j] for w, j in zip(weights, visible))
    assert_close(A.attention(q, k, v, mask), expected, name="attention vs a per-query loop")


def test_attention_validates_inputs():
    q, k, v = np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 2))
    with pytest.raises(ValueError, match=r"k: expected head dim D = 4 \(from q\), got 5"):
        A.attention(q, np.ones((3, 5)), v)
    with pytest.raises(
        ValueError, match=r"v: expected leading shape \(3,\) \(from k\), got \(2,\)"
    ):
        A.attention(q, k, np.ones((2, 2)))
    with pytest.raises(TypeError, match="mask: expected a bool array"):
        A.attention(q, k, v, np.ones((2, 3)))
    with pytest.raises(
        ValueError, match=r"mask: expected shape \(2, 3\) \(T queries x S keys\), got \(2, 2\)"
    ):
        A.attention(q, k, v, np.ones((2, 2), dtype=bool))
    with pytest.raises(ValueError, match="every query row needs at least one True"):
        A.attention(q, k, v, np.zeros((2, 3), dtype=bool))


def test_cached_attention_step_equals_full_recompute():
    rng = np.random.default_rng(2)
    qs, ks = rng.normal(size=(2, 6, 4))
    vs = rng.normal(size=(6, 3))
    k_cache, v_cache = np.zeros((0, 4)), np.zeros((0, 3))
    for t in range(6):
        out, k_cache, v_cache = A.cached_attention_step(qs[t], ks[t], vs[t], k_cache, v_cache)
        check_shape(k_cache, (t + 1, 4), "k_cache")
        expected = A.attention(qs[: t + 1], ks[: t + 1], vs[: t + 1], A.causal_mask(t + 1, t + 1))[
            -1
        ]
        assert_close(out, expected, name=f"decode step {t}")
    with pytest.raises(ValueError, match="k_new, k_cache"):
        A.cached_attention_step(qs[0], ks[0], vs[0], np.zeros((2, 5)), np.zeros((2, 3)))


@pytest.mark.parametrize("num_layers,prompt_len,new_tokens", [(1, 1, 1), (2, 8, 30), (3, 5, 12)])
def test_cached_generation_equals_naive(num_layers, prompt_len, new_tokens):
    model = ToyModel(ToyConfig(num_layers=num_layers), seed=num_layers)
    prompt = np.arange(prompt_len) * 7 % 64
    naive = generate_naive(model, prompt, new_tokens)
    cached = generate_cached(model, prompt, new_tokens)
    assert np.array_equal(naive.tokens, cached.tokens), (
        f"tokens differ: {naive.tokens} vs {cached.tokens}"
    )
    assert_close(cached.logits, naive.logits, name="cached vs naive logits", rtol=1e-10, atol=1e-10)


def test_chunked_prefill_equals_one_shot():
    model = ToyModel(ToyConfig(), seed=3)
    tokens = np.random.default_rng(3).integers(0, 64, size=23)
    one_shot = model.forward(tokens)
    cache = model.new_cache(23)
    chunks = [
        model.forward(tokens[a:b], cache=cache) for a, b in [(0, 7), (7, 8), (8, 20), (20, 23)]
    ]
    assert_close(
        np.concatenate(chunks), one_shot, name="chunked prefill logits", rtol=1e-10, atol=1e-10
    )


def test_op_counts_match_closed_forms():
    model = ToyModel(ToyConfig(num_layers=3))
    prompt_len, n, layers = 6, 9, 3
    naive = generate_naive(model, np.arange(prompt_len), n)
    cached = generate_cached(model, np.arange(prompt_len), n)
    assert [c.score_entries for c in naive.step_counts] == [
        layers * m * m for m in range(prompt_len, prompt_len + n)
    ]
    assert [c.projected_rows for c in naive.step_counts] == [
        layers * m for m in range(prompt_len, prompt_len + n)
    ]
    expected_cached = [layers * prompt_len**2] + [layers * (prompt_len + i) for i in range(1, n)]
    assert [c.score_entries for c in cached.step_counts] == expected_cached
    assert [c.projected_rows for c in cached.step_counts] == [layers * prompt_len] + [layers] * (
        n - 1
    )


def test_kv_cache_layout_bytes_and_errors():
    cache = ToyKVCache(num_layers=2, max_seq_len=5, head_dim=3)
    k, v = np.ones((4, 3)), 2 * np.ones((4, 3))
    keys, values = cache.update(0, k, v)
    assert np.shares_memory(keys, cache.buffer) and keys.shape == (4, 3) and np.all(values == 2)
    cache.update(1, k, v)
    cache.advance(4)
    assert cache.used_bytes == cache.buffer[:, :, :4].nbytes == dense_kv_cache_bytes(2, 1, 3, 8, 4)
    with pytest.raises(
        CacheOverflowError, match="holds at most 5 tokens; writing 2 after 4 needs 6"
    ):
        cache.update(0, np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"layer_idx: expected an int in \[0, 2\), got 2"):
        cache.update(2, k, v)
    with pytest.raises(ValueError, match=r"expected equal shapes \(T, 3\)"):
        cache.update(0, np.ones((1, 4)), np.ones((1, 4)))


def test_dense_kv_cache_bytes_known_values_and_validation():
    # Llama 2 7B, fp16: 512 KiB/token
    assert dense_kv_cache_bytes(32, 32, 128, 2, 1) == 512 * 1024
    assert dense_kv_cache_bytes(80, 8, 128, 2, 1) == 320 * 1024  # Llama 2 70B (GQA, 8 KV heads)
    assert dense_kv_cache_bytes(2, 2, 2, 2, 0) == 0
    with pytest.raises(ValueError, match="num_layers: expected an int >= 1, got 0"):
        dense_kv_cache_bytes(0, 1, 1, 1, 1)
    with pytest.raises(TypeError, match="head_dim: expected an int, got float"):
        dense_kv_cache_bytes(1, 1, 1.5, 1, 1)


def test_generation_rejects_bad_arguments():
    model = ToyModel()
    with pytest.raises(ValueError, match="prompt_ids: expected at least one token"):
        generate_cached(model, np.array([], dtype=int), 3)
    with pytest.raises(ValueError, match=r"token_ids: expected 1\+ ids in \[0, 64\)"):
        model.forward(np.array([64]))
    cache = model.new_cache(10)
    generate_cached(model, np.array([1, 2]), 2, cache=cache)
    with pytest.raises(ValueError, match="expected an empty cache, got one holding 3 tokens"):
        generate_cached(model, np.array([1, 2]), 2, cache=cache)
    with pytest.raises(CacheOverflowError):
        generate_cached(model, np.array([1, 2]), 20, cache=model.new_cache(5))


def test_bench_helpers():
    sizes = np.array([2, 4, 8, 16])
    assert loglog_slope(sizes, 3.0 * sizes**2.5) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="positive"):
        loglog_slope([1, 2], [0, 1])
    calls = []
    times = interleaved_times_ms(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1
    )
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed rounds, interleaved
    assert [len(t) for t in times.values()] == [3, 3] and min(times["a"] + times["b"]) >= 0
    with pytest.raises(TypeError, match=r"fns\['x'\]: expected a callable"):
        interleaved_times_ms({"x": 42})
    with pytest.raises(ValueError, match="fns: expected at least one callable"):
        interleaved_times_ms({})


def test_decode_animation_has_one_frame_per_step():
    from kvlib.course.viz import decode_animation, decode_frames

    model, prompt = ToyModel(), np.array([1, 2, 3])
    frames = decode_frames(model, prompt, num_steps=4)
    assert [f.keys.shape[0] for f in frames] == [4, 5, 6, 7]  # one row per decode step
    final = model.new_cache(7)
    generate_cached(model, prompt, 5, cache=final)  # the same decoding, all at once
    assert np.array_equal(frames[-1].keys, final.buffer[0, 0, :7])
    assert all(np.isclose(f.weights.sum(), 1.0) for f in frames)
    with pytest.raises(ValueError, match="num_steps: expected an int >= 1"):
        decode_frames(model, prompt, num_steps=0)
    animation = decode_animation(model, prompt, num_steps=4)
    assert list(animation.new_frame_seq()) == [0, 1, 2, 3]
    # what the book embeds: one PNG per frame, playable without a kernel
    html = animation.to_jshtml()
    assert html.count("data:image/png;base64") == 4


def test_check_shape():
    check_shape(np.zeros((2, 3)), (2, None))
    with pytest.raises(ValueError, match=r"k: expected shape \(2, 4\), got \(2, 3\)"):
        check_shape(np.zeros((2, 3)), (2, 4), "k")


def test_stable_times_ms_returns_agreeing_minima_or_says_the_machine_was_busy(monkeypatch):
    import time

    import kvlib.course.bench as bench

    script, calls = [], []

    def fake(fns, *, repeats, warmup=1):
        calls.append((repeats, warmup))
        return script.pop(0)

    monkeypatch.setattr(bench, "interleaved_times_ms", fake)
    script[:] = [{"a": [10.0, 9.0], "b": [2.0]}, {"a": [9.5], "b": [2.1]}]  # within 20%: agree
    assert bench.stable_times_ms({"a": None, "b": None}, repeats=2) == ({"a": 9.0, "b": 2.0}, True)
    assert calls == [(2, 2), (2, 0)]  # warm-up before the first measurement only
    clock = iter(range(100))  # a clock at which each reading is one second later
    monkeypatch.setattr(bench.time, "perf_counter", lambda: float(next(clock)))
    script[:] = [{"a": [10.0]}, {"a": [20.0]}, {"a": [5.0]}, {"a": [40.0]}]  # never agree
    assert bench.stable_times_ms({"a": None}, cap_s=2.5) == ({"a": 5.0}, False)  # 3 s > 2.5 s
    monkeypatch.undo()
    monkeypatch.setattr(bench, "interleaved_times_ms", fake)
    script[:], calls[:] = [{"a": [7.0]}], []
    past = time.perf_counter() - 1  # the cell's deadline has passed: one round, not stable
    assert bench.stable_times_ms({"a": None}, deadline=past) == ({"a": 7.0}, False)
    assert calls == [(1, 1)]
    with pytest.raises(ValueError, match="agree, cap_s"):
        bench.stable_times_ms({"a": None}, agree=0)
