"""Chapter 1's graded questions: a stable softmax, the cached decode step, op counts, cache bytes.

Each test receives the learner's definitions as a `Submission` and compares them with kvlib's
reference implementations on fixed inputs and on random ones drawn afresh on every run.
"""

from __future__ import annotations

import functools

import numpy as np

from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Submission, expect_int, question
from kvlib.memory.formula import dense_kv_cache_bytes
from kvlib.ref.attention import attention, causal_mask, softmax
from kvlib.ref.toy_generation import generate_cached, generate_naive
from kvlib.ref.toy_model import ToyConfig, ToyModel
from kvlib.testing import assert_close


@question(function="stable_softmax")
def test_stable_softmax(submission: Submission) -> None:
    stable_softmax = submission.function("stable_softmax")
    if submission.fixed_cases:
        rng = np.random.default_rng(1)
        x = rng.normal(size=(4, 7))
        got = stable_softmax(x.copy())
        assert isinstance(got, np.ndarray), (
            f"stable_softmax should return a numpy array, got {type(got).__name__}"
        )
        with naming_mistakes(got, _softmax_mistakes(x)):
            assert_close(got, softmax(x), name="stable_softmax(x) for a (4, 7) input")
        for large in (
            np.array([[1000.0, 1001.0, 1002.0], [-1000.0, -1001.0, -1002.0]]),
            np.array([[-800.0, 0.0, 800.0], [5.0, -700.0, 700.0]]),  # shifting by the min overflows
            np.array([[-100.0, 0.0, 100.0]], dtype=np.float32),  # exp(200) overflows float32
        ):
            got = np.asarray(stable_softmax(large.copy()))
            assert np.all(np.isfinite(got)), (
                f"stable_softmax({large.tolist()}) ({large.dtype}) gave {got.tolist()}: exp of a "
                "large score overflows. Subtract each row's maximum before exponentiating."
            )
            assert_close(got, softmax(large.astype(np.float64)), name="stable_softmax of large "
                         f"scores {large.tolist()}", rtol=1e-5, atol=1e-7)  # fmt: skip
        batched = rng.normal(size=(2, 3, 5)) * 50
        got = stable_softmax(batched.copy())
        with naming_mistakes(got, _softmax_mistakes(batched)):
            assert_close(
                got, softmax(batched), name="stable_softmax over the last axis of a (2, 3, 5) input"
            )
    drawn = submission.rng()  # drawn afresh on every run
    for dtype in (np.float32, np.float64):  # the output keeps the input's dtype
        shape = tuple(int(n) for n in drawn.integers(1, 7, size=int(drawn.integers(1, 4))))
        magnitude = float(10 ** drawn.uniform(0, 3))
        x = (drawn.normal(size=shape) * magnitude + drawn.normal() * magnitude).astype(dtype)
        got = stable_softmax(x.copy())
        what = f"stable_softmax of a {x.dtype} input of shape {shape}, scores ~{magnitude:.3g}"
        assert isinstance(got, np.ndarray) and got.dtype == x.dtype, (
            f"{what}: expected a {x.dtype} numpy array (the input's dtype), got "
            f"{type(got).__name__} {getattr(got, 'dtype', '')}"
        )
        tolerance = {"rtol": 1e-5, "atol": 1e-7} if x.dtype == np.float32 else {}
        with naming_mistakes(got, _softmax_mistakes(x.astype(np.float64)), rtol=1e-4, atol=1e-6):
            assert_close(got, softmax(x.astype(np.float64)), name=what, **tolerance)


def _softmax_mistakes(x: np.ndarray) -> dict:
    """stable_softmax's common mistakes on `x`, and what each returns."""
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    return {
        "the softmax over the first axis instead of the last": lambda: softmax(x, axis=0),
        "the softmax over the second-to-last axis instead of the last": lambda: softmax(x, axis=-2),
        "exp(x - max) divided by the sum of the whole array, not each row's": lambda: (
            shifted / shifted.sum()
        ),
        "exp(x - max) left undivided (normalise each row by its sum)": lambda: shifted,
    }


@question(function="cached_attention_step")
def test_cached_attention_step(submission: Submission) -> None:
    step = submission.function("cached_attention_step")
    rng, drawn = np.random.default_rng(2), submission.rng()
    cases = submission.fixed([(6, 4, 3, 1.0), (5, 4, 3, 3000.0)])  # scores in the thousands
    cases.append((int(drawn.integers(1, 9)), int(drawn.integers(1, 9)), int(drawn.integers(1, 6)),
                  float(10 ** drawn.uniform(0, 4))))  # fmt: skip
    for num_steps, head_dim, value_dim, magnitude in cases:
        _check_steps(step, rng, num_steps, head_dim, value_dim, magnitude)


def _check_steps(step, rng, num_steps, head_dim, value_dim, magnitude) -> None:
    qs, ks = rng.normal(size=(2, num_steps, head_dim))
    qs = qs * magnitude  # scores ~magnitude: large ones overflow an exp not shifted by the max
    vs = rng.normal(size=(num_steps, value_dim))
    k_cache, v_cache = np.zeros((0, head_dim)), np.zeros((0, value_dim))
    for t in range(num_steps):
        result = step(qs[t], ks[t], vs[t], k_cache, v_cache)
        assert isinstance(result, tuple) and len(result) == 3, (
            "cached_attention_step should return a tuple (out, k_cache, v_cache), got "
            f"{type(result).__name__}"
        )
        out, k_cache, v_cache = (np.asarray(r) for r in result)
        assert k_cache.shape == (t + 1, head_dim) and v_cache.shape == (t + 1, value_dim), (
            f"after step {t} the caches should hold {t + 1} rows: expected shapes "
            f"{(t + 1, head_dim)} and "
            f"{(t + 1, value_dim)}, got {k_cache.shape} and {v_cache.shape}"
        )
        assert np.array_equal(k_cache, ks[: t + 1]) and np.array_equal(v_cache, vs[: t + 1]), (
            f"after step {t} the caches should hold the rows in the order they came, the new "
            "one last: row i is token i's key (value)"
        )
        expected = attention(qs[: t + 1], ks[: t + 1], vs[: t + 1], causal_mask(t + 1, t + 1))[
            -1
        ]  # full recompute
        with naming_mistakes(out, _step_mistakes(qs[t], ks[: t + 1], vs[: t + 1])):
            assert_close(
                out,
                expected,
                name=f"output of step {t} (cache of {t + 1} tokens, the new one included; D="
                f"{head_dim}, D_v={value_dim}, scores ~{magnitude:.3g})",
            )


def _step_mistakes(q, k, v) -> dict:
    """cached_attention_step's common mistakes, for one query over the cache (new row last)."""
    return {
        "scores not scaled by 1/√D": lambda: attention(q[None], k, v, scale=1.0)[0],
        "scores divided by D instead of √D": lambda: attention(q[None], k, v, scale=1 / k.shape[1])[
            0
        ],
        "attention over the earlier tokens only: the new token's own key and value are left out "
        "(append before attending)": lambda: (
            attention(q[None], k[:-1], v[:-1])[0] if len(k) > 1 else np.zeros(v.shape[1])
        ),
        "attention over the new token only (the cache is not read)": lambda: v[-1].copy(),
        "K and V swapped (scores from the values, the keys averaged)": lambda: attention(
            q[None], v, k
        )[0],
        "the weights of a softmax over the score's unnormalised exp (no division by the sum)": (
            lambda: np.exp(k @ q / np.sqrt(k.shape[1])) @ v
        ),
    }


@functools.lru_cache(maxsize=4096)
def _score_entries(prompt_len: int, max_new_tokens: int, num_layers: int, cached: bool) -> int:
    """What the instrumented toy generation counts."""
    model = ToyModel(ToyConfig(vocab_size=16, d_model=8, head_dim=4, num_layers=num_layers))
    generate = generate_cached if cached else generate_naive
    prompt = np.arange(prompt_len) % 16
    return generate(model, prompt, max_new_tokens).total_counts.score_entries


@question(function="predict_score_entries")
def test_predict_score_entries(submission: Submission) -> None:
    predict = submission.function("predict_score_entries")
    drawn = submission.rng()
    cases = submission.fixed([(1, 1, 1), (5, 7, 2), (12, 4, 3), (3, 20, 1)])
    cases += [tuple(int(n) for n in drawn.integers(1, (16, 16, 4))) for _ in range(2)]  # per run
    for prompt_len, max_new_tokens, num_layers in cases:
        for cached in (False, True):
            measured = _score_entries(prompt_len, max_new_tokens, num_layers, cached)
            got = predict(prompt_len, max_new_tokens, num_layers, cached)
            label = "cached" if cached else "naive"
            expect_int(got, "predict_score_entries")
            other = "cached" if not cached else "naive"
            mistakes = {
                f"the count of one layer (multiply by num_layers={num_layers})": lambda: (
                    _score_entries(prompt_len, max_new_tokens, 1, cached)
                ),
                f"the {other} loop's count": lambda: _score_entries(
                    prompt_len, max_new_tokens, num_layers, not cached
                ),
                "one decode step too few (off by one)": lambda: _score_entries(
                    prompt_len, max_new_tokens - 1, num_layers, cached
                ),
                "one decode step too many (off by one)": lambda: _score_entries(
                    prompt_len, max_new_tokens + 1, num_layers, cached
                ),
            }
            with naming_mistakes(got, mistakes):
                assert got == measured, (
                    f"{label} generation with prompt_len={prompt_len}, "
                    f"max_new_tokens={max_new_tokens}, "
                    f"num_layers={num_layers}: the instrumented loop computed {measured} score "
                    f"entries, you predicted {got}"
                )


@question(function="kv_cache_bytes")
def test_kv_cache_bytes(submission: Submission) -> None:
    kv_cache_bytes = submission.function("kv_cache_bytes")
    rng = submission.rng()
    cases = submission.fixed(
        [(32, 32, 128, 2, 1), (32, 32, 128, 2, 4096), (80, 8, 128, 2, 1000), (1, 1, 16, 8, 0)]
    )
    cases += [  # drawn afresh on every run
        tuple(
            int(x)
            for x in (*rng.integers(1, 100, size=3), rng.choice([1, 2, 4]), rng.integers(0, 10**5))
        )
        for _ in range(3)
    ]
    for args in cases:
        got = kv_cache_bytes(*args)
        expected = dense_kv_cache_bytes(*args)
        expect_int(got, "kv_cache_bytes")
        layers, heads, head_dim, element_bytes, seq_len = args
        mistakes = {
            "K only: V is cached too (a factor 2)": lambda: expected // 2,
            "bits, not bytes (8 bits a byte)": lambda: expected * 8,
            "one layer's cache: every layer has its own (a factor num_layers)": lambda: (
                2 * heads * head_dim * element_bytes * seq_len
            ),
            "one head's cache: every head has its own K and V (a factor num_heads)": lambda: (
                2 * layers * head_dim * element_bytes * seq_len
            ),
            "elements, not bytes (multiply by bytes_per_element)": lambda: (
                2 * layers * heads * head_dim * seq_len
            ),
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"kv_cache_bytes(num_layers={args[0]}, num_heads={args[1]}, head_dim={args[2]}, "
                f"bytes_per_element={args[3]}, "
                f"seq_len={args[4]}) should be {expected}, got {got}"
            )
    if submission.fixed_cases:
        model = ToyModel(ToyConfig(num_layers=3, head_dim=8))
        cache = model.new_cache(64)
        generate_cached(model, np.arange(10), 5, cache=cache)
        allocated = cache.buffer[:, :, : cache.length].nbytes  # what the filled rows occupy
        got = kv_cache_bytes(3, 1, 8, cache.buffer.itemsize, cache.length)
        assert got == allocated, (
            f"the toy model's filled cache occupies {allocated} bytes; your formula gives {got}"
        )


@functools.lru_cache(maxsize=4096)
def _projected_rows(prompt_len: int, max_new_tokens: int, cached: bool) -> int:
    """Token rows the instrumented one-layer toy pushes through W_k (and W_q, W_v, W_o)."""
    model = ToyModel(ToyConfig(vocab_size=16, d_model=8, head_dim=4, num_layers=1))
    generate = generate_cached if cached else generate_naive
    prompt = np.arange(prompt_len) % 16
    return generate(model, prompt, max_new_tokens).total_counts.projected_rows


@question(function="predict_recomputed_k_rows")
def test_predict_recomputed_k_rows(submission: Submission) -> None:
    """A prediction question: how many K rows the naive loop computes again (one layer)."""
    predict = submission.function("predict_recomputed_k_rows")
    drawn = submission.rng()
    cases = submission.fixed([(1, 1), (4, 3), (10, 5), (1, 12)])
    cases += [tuple(int(n) for n in drawn.integers(1, (40, 40))) for _ in range(3)]  # per run
    for prompt_len, max_new_tokens in cases:
        naive = _projected_rows(prompt_len, max_new_tokens, False)
        expected = naive - _projected_rows(prompt_len, max_new_tokens, True)  # new rows: cached
        got = predict(prompt_len, max_new_tokens)
        expect_int(got, "predict_recomputed_k_rows")
        mistakes = {
            "every K row the naive loop computes, the new ones included (subtract the rows a "
            "cache computes once: the prompt's and each fed-back token's)": lambda: naive,
            "the rows of the last step only": lambda: prompt_len + max_new_tokens - 1,
            "one step too many (the last generated token is never fed back)": lambda: (
                _projected_rows(prompt_len, max_new_tokens + 1, False)
                - _projected_rows(prompt_len, max_new_tokens + 1, True)
            ),
            "the prompt's rows recomputed on every decode step, the generated tokens' forgotten": (
                lambda: prompt_len * (max_new_tokens - 1)
            ),
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"prompt_len={prompt_len}, max_new_tokens={max_new_tokens}: the instrumented "
                f"naive loop computed {naive} K rows, {expected} of them again (a cache computes "
                f"{naive - expected} once); you predicted {got}"
            )
