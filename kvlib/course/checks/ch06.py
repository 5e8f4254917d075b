"""Chapter 6's graded questions: the absorbed MLA score, latent cache bytes, and the shared rotary
key. Oracles: kvlib's own implementations, and the rotation in float64 (chapter 2's)."""

from __future__ import annotations

import torch

from kvlib.course.checks.ch02 import EPS32, assert_rotated, rope_exact, rope_mistakes
from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import (
    Submission,
    expect_int,
    expect_tensor,
    peak_allocation,
    question,
)
from kvlib.memory import kv_cache_bytes
from kvlib.testing import assert_close


def _score_inputs(batch, heads, queries, keys, d_h, d_r, d_c, seed):
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(batch, heads, queries, d_h, generator=g)
    q_rope = torch.randn(batch, heads, queries, d_r, generator=g)
    w_uk = torch.randn(heads, d_h, d_c, generator=g) / d_c**0.5
    latent = torch.randn(batch, keys, d_c, generator=g)
    rope_key = torch.randn(batch, keys, d_r, generator=g)
    return q_nope, q_rope, w_uk, latent, rope_key


def _expanded_scores(q_nope, q_rope, w_uk, latent, rope_key, *, width=None, rope=True,
                     content=True):  # fmt: skip
    """DeepSeek-V2's eq. (17)-(18) written out: every head's keys up-projected, then dotted
    (scaled by 1/sqrt(`width`), d_h + d_R unless given; `rope`, `content`: which parts)."""
    k_nope = torch.einsum("hdc,bsc->bhsd", w_uk.double(), latent.double())  # (B, H, S, d_h)
    scores = q_nope.double() @ k_nope.transpose(-1, -2) * float(content)
    scores = scores + q_rope.double() @ rope_key.double()[:, None].transpose(-1, -2) * float(rope)
    width = q_nope.shape[-1] + q_rope.shape[-1] if width is None else width
    return scores / width**0.5


def _absorbed_mistakes(inputs) -> dict:
    d_h, d_c = inputs[0].shape[-1], inputs[2].shape[-1]
    return {
        "scaled by 1/sqrt(d_h): the score's width is d_h + d_R": lambda: _expanded_scores(
            *inputs, width=d_h
        ),
        "scaled by 1/sqrt(d_c), the absorbed width: the score's width is d_h + d_R": lambda: (
            _expanded_scores(*inputs, width=d_c)
        ),
        "not scaled: divide by sqrt(d_h + d_R)": lambda: _expanded_scores(*inputs, width=1),
        "the rotary part q_R · k_R left out": lambda: _expanded_scores(*inputs, rope=False),
        "the content part left out (only q_R · k_R)": lambda: _expanded_scores(
            *inputs, content=False
        ),
    }


@question(function="absorbed_scores")
def test_absorbed_scores(submission: Submission) -> None:
    absorbed_scores = submission.function("absorbed_scores")
    drawn = submission.rng()
    queries = int(drawn.integers(1, 5))  # drawn afresh on every run
    random_case = (
        *(int(n) for n in drawn.integers(1, 4, size=2)),
        queries,
        queries + int(drawn.integers(0, 9)),
        *(int(n) for n in drawn.integers(1, 9, size=3) * 2),
    )
    fixed = [
        (1, 2, 1, 5, 4, 2, 6),  # decode
        (2, 4, 3, 3, 8, 4, 16),  # prefill
        (1, 3, 2, 7, 6, 2, 10),  # a chunk after 5 cached tokens
    ]
    for batch, heads, queries, keys, d_h, d_r, d_c in [*submission.fixed(fixed), random_case]:
        inputs = _score_inputs(batch, heads, queries, keys, d_h, d_r, d_c, seed=keys)
        got = absorbed_scores(*inputs)
        assert isinstance(got, torch.Tensor), (
            f"absorbed_scores should return a torch.Tensor, got {type(got).__name__}"
        )
        assert tuple(got.shape) == (batch, heads, queries, keys), (
            f"with B={batch}, H={heads}, T={queries}, S={keys}: expected scores of shape "
            f"{(batch, heads, queries, keys)}, got {tuple(got.shape)}"
        )
        assert got.dtype == inputs[0].dtype, (
            f"absorbed_scores should keep the inputs' dtype {inputs[0].dtype}, got {got.dtype}"
        )
        with naming_mistakes(got, _absorbed_mistakes(inputs), rtol=1e-4, atol=1e-5):
            assert_close(
                got.double(),
                _expanded_scores(*inputs),
                name=f"absorbed scores with H={heads}, d_h={d_h}, d_R={d_r}, d_c={d_c} (content "
                "part (W_UK,iᵀ q_C) · c_KV plus rotary part q_R · k_R, scaled by 1/sqrt(d_h + "
                "d_R))",
                rtol=1e-4,
                atol=1e-5,
            )
    if not submission.fixed_cases:
        return
    # decode over a long cache: the point of absorption is never to build per-head keys, not
    # even one head's (here d_h > d_c: one head's keys take 32 MiB, an absorbed query 64 B)
    # Two measured calls on inputs drawn afresh (nothing to memoise or look up), the larger peak
    # kept: the cases before ran the same code, so a first call pays no warm-up here
    heads, keys, d_h, d_r, d_c = 4, 8192, 1024, 16, 16
    one_head, peaks = keys * d_h * 4, []
    for _ in range(2):
        inputs = _score_inputs(1, heads, 1, keys, d_h, d_r, d_c, seed=int(drawn.integers(2**31)))
        call = absorbed_scores.call(*inputs, _options={"measure_memory": True})
        expected, what = _expanded_scores(*inputs), f"absorbed_scores with H={heads}, S={keys}"
        expect_tensor(call.result, expected.float(), what)
        assert_close(call.result.double(), expected, name=what, rtol=1e-4, atol=1e-5)
        peaks.append(peak_allocation(call.info))
    peak, described = max(peaks)
    assert peak < one_head // 4, (
        f"with H={heads}, S={keys}, d_h={d_h}, d_c={d_c} your function's peak allocation was "
        f"{described}; one head's up-projected keys take {one_head / 2**20:.0f} MiB, every "
        f"head's {heads * one_head / 2**20:.0f} MiB: fold W_UK into the query instead "
        "(W_UK,iᵀ q_C,i, once per query and head) and dot it with the cached latents"
    )


_LATENT_CONFIGS = [
    # (config, seq_len, batch_size)
    ({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
      "torch_dtype": "bfloat16"}, 4096, 1),
    ({"num_hidden_layers": 60, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
      "torch_dtype": "bfloat16"}, 128 * 1024, 8),
    ({"num_hidden_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
      "torch_dtype": "float32"}, 1000, 3),
    ({"num_hidden_layers": 4, "kv_lora_rank": 112, "qk_rope_head_dim": 16,
      "torch_dtype": "float32"}, 256, 16),
]  # fmt: skip


@question(
    function="latent_cache_bytes",
)
def test_latent_cache_bytes(submission: Submission) -> None:
    latent_cache_bytes = submission.function("latent_cache_bytes")
    drawn, cases = submission.rng(), submission.fixed(_LATENT_CONFIGS)
    for _ in range(3):  # drawn afresh on every run
        config = {
            "num_hidden_layers": int(drawn.integers(1, 100)),
            "kv_lora_rank": int(drawn.integers(1, 17)) * 32,
            "qk_rope_head_dim": int(drawn.choice([16, 32, 64])),
            "torch_dtype": str(drawn.choice(["bfloat16", "float16", "float32"])),
        }
        if drawn.random() < 0.5:  # heads are irrelevant to the latent cache
            config["num_attention_heads"] = int(drawn.integers(1, 129))
        cases.append((config, int(drawn.integers(1, 2**17)), int(drawn.integers(1, 65))))
    for config, seq_len, batch_size in cases:
        expected = kv_cache_bytes(
            {**config, "model_type": "deepseek_v2"}, seq_len, batch_size=batch_size
        )
        got = latent_cache_bytes(dict(config), seq_len, batch_size)
        expect_int(got, "latent_cache_bytes")
        fields = ", ".join(f"{k}={v}" for k, v in config.items())
        layers, rank, rope = (config[k] for k in ("num_hidden_layers", "kv_lora_rank",
                                                   "qk_rope_head_dim"))  # fmt: skip
        per_value = expected // (layers * (rank + rope))  # bytes per element x tokens
        mistakes = {
            "the latent only: the shared rotary key (qk_rope_head_dim) is cached too": lambda: (
                layers * rank * per_value
            ),
            "one layer: the latent is cached per layer (a factor num_hidden_layers)": lambda: (
                (rank + rope) * per_value
            ),
            "one sequence: multiply by batch_size": lambda: expected // batch_size,
            "a latent per head: MLA caches one per token, shared by every head": lambda: (
                expected * config["num_attention_heads"]
            ),
            "twice the latent, as if K and V were cached apart: MLA caches one latent": lambda: (
                2 * expected
            ),
            "bits, not bytes": lambda: expected * 8,
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"for {fields}, {batch_size} sequences of {seq_len} tokens: expected "
                f"{expected:,} bytes (one row of kv_lora_rank + qk_rope_head_dim values per token "
                f"per layer, whatever the number of heads), got {got:,}"
            )


@question(
    function="shared_rotary_key",
)
def test_shared_rotary_key(submission: Submission) -> None:
    shared_rotary_key = submission.function("shared_rotary_key")
    g, drawn = torch.Generator().manual_seed(3), submission.rng()
    random_case = (  # drawn afresh on every run
        *(int(n) for n in drawn.integers(1, (4, 8, 24))),
        2 * int(drawn.integers(1, 9)),
        int(drawn.integers(0, 5000)),
        float(drawn.choice([10000.0, 500000.0])),
    )
    fixed = [
        (1, 4, 8, 4, 0, 10000.0),
        (2, 6, 16, 8, 0, 10000.0),
        (1, 3, 12, 6, 37, 500000.0),  # a chunk starting at position 37
        (1, 2, 8, 8, 4990, 1e6),
    ]
    for batch, tokens, d_model, d_r, start, theta in [*submission.fixed(fixed), random_case]:
        x = torch.randn(batch, tokens, d_model, generator=g)
        w_kr = torch.randn(d_r, d_model, generator=g) / d_model**0.5
        positions = torch.arange(start, start + tokens)
        key = (x.double() @ w_kr.double().T)[:, None]  # (B, 1, T, d_R), exact
        expected, allowed = rope_exact(key, positions, theta)
        allowed = allowed + 8 * EPS32 * (x.double().abs() @ w_kr.double().abs().T)[:, None]
        got = shared_rotary_key(x, w_kr, positions, theta)
        assert isinstance(got, torch.Tensor), (
            f"shared_rotary_key should return a torch.Tensor, got {type(got).__name__}"
        )
        assert tuple(got.shape) == tuple(expected.shape), (
            f"with B={batch}, T={tokens}, d_R={d_r}: expected shape {tuple(expected.shape)} (one "
            f"rotary key per token, shared by all heads: a head axis of 1), got {tuple(got.shape)}"
        )
        assert got.dtype == x.dtype, (
            f"shared_rotary_key should keep the input's dtype {x.dtype}, got {got.dtype}"
        )
        mistakes = dict(rope_mistakes(key, start, theta))
        mistakes["frequencies of a 128-wide head, not of d_R: theta^(-2i/d_R)"] = lambda: (
            rope_exact(key, torch.arange(start, start + tokens), float(theta) ** (d_r / 128))[0]
        )
        with naming_mistakes(got, mistakes, rtol=1e-3, atol=float(allowed.max())):
            assert_rotated(
                got,
                expected,
                allowed,
                f"the rotary key with d_R={d_r}, positions {start}..{start + tokens - 1}, "
                f"theta={theta:g} (frequencies theta^(-2i/d_R); dimension i pairs with i + d_R/2)",
            )
