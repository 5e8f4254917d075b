"""Chapter 5's graded questions: grouped attention without repeating K/V, the mean-pooling
conversion of a key/value projection, and the KV heads a memory budget allows. Oracles: kvlib's
own implementations."""

from __future__ import annotations

import numpy as np
import torch

from kvlib.conversions.gqa import pool_kv_heads
from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import (
    Submission,
    expect_int,
    expect_tensor,
    peak_allocation,
    question,
)
from kvlib.memory import kv_cache_bytes
from kvlib.ops.attention import grouped_attention
from kvlib.testing import assert_close


def _qkv(batch, heads, kv_heads, queries, keys, dim, seed, *, mask="causal", scale=1.0, g=None):
    g = torch.Generator().manual_seed(seed) if g is None else g
    q = torch.randn(batch, heads, queries, dim, generator=g) * scale
    k = torch.randn(batch, kv_heads, keys, dim, generator=g)
    v = torch.randn(batch, kv_heads, keys, dim, generator=g)
    if mask == "causal":
        mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    else:  # any pattern (a sliding window, padding, a tree of drafts): one key per row at least
        mask = torch.rand(queries, keys, generator=g) < 0.5
        mask[torch.arange(queries), torch.randint(keys, (queries,), generator=g)] = True
    return q, k, v, mask


@question(function="grouped_attention", torch_ops=True)
def test_grouped_attention(submission: Submission) -> None:
    attend = submission.function("grouped_attention")
    g = submission.torch_generator()
    random_cases = []
    for _ in range(2):  # drawn afresh on every run
        kv_heads, group = (int(x) for x in torch.randint(1, 4, (2,), generator=g))
        queries = int(torch.randint(1, 6, (1,), generator=g))
        keys = queries + int(torch.randint(0, 12, (1,), generator=g))
        random_cases.append((2, kv_heads * group, kv_heads, queries, keys, "random", 1.0))
    fixed = [
        (1, 4, 4, 3, 3, "causal", 1.0),  # MHA
        (2, 8, 2, 1, 17, "causal", 1.0),  # GQA decode
        (1, 6, 3, 4, 9, "causal", 1.0),  # GQA, a chunk after 5 cached tokens
        (2, 4, 1, 5, 5, "causal", 1.0),  # MQA prefill
        (1, 4, 2, 4, 7, "random", 1.0),  # a mask that is not causal
        (1, 4, 2, 3, 6, "causal", 200.0),  # scores in the thousands: exp overflows unshifted
    ]
    for batch, heads, kv_heads, queries, keys, mask_kind, scale in [
        *submission.fixed(fixed),
        *random_cases,
    ]:
        q, k, v, mask = _qkv(
            batch, heads, kv_heads, queries, keys, 8, seed=keys, mask=mask_kind, scale=scale, g=g
        )
        call = attend.call(q, k, v, mask, _options={"torch_ops": submission.fixed_cases})
        got = call.result
        ops = call.info.get("torch_ops", ())
        if isinstance(ops, list) and any("scaled_dot_product" in str(op) for op in ops):
            submission.flag(
                "grouped_attention calls PyTorch's scaled_dot_product_attention, whose enable_gqa "
                "does the whole exercise: write the scores, the mask, the softmax and the "
                "weighted sum yourself"
            )
        expected = grouped_attention(q, (k, v), mask[None])
        what = (
            f"grouped_attention with B={batch}, H={heads}, H_kv={kv_heads}, T={queries}, S={keys}"
            f", a {mask_kind} mask" + (f", queries scaled by {scale:g}" if scale != 1 else "")
        )
        expect_tensor(got, expected, what)
        assert torch.isfinite(got).all(), (
            f"{what}: your output has non-finite values (subtract each row's maximum score "
            "before exponentiating, or use torch.softmax)"
        )
        with naming_mistakes(got, _grouped_mistakes(q, k, v, mask), rtol=1e-4, atol=1e-5):
            assert_close(
                got,
                expected,
                name=f"{what} (query head h reads KV head h // G; the mask as given)",
                rtol=1e-4,
                atol=1e-5,
            )
    if not submission.fixed_cases:
        return
    # decode over a long cache: nothing the size of K or V repeated to H heads may be allocated.
    # Two measured calls on inputs drawn afresh (nothing to memoise or look up), the larger peak
    # kept: the cases before ran the same code, so a first call pays no warm-up here
    heads, kv_heads, keys, dim = 16, 2, 4096, 64
    repeated, peaks = 2 * heads * keys * dim * 4, []
    for _ in range(2):
        q, k, v, mask = _qkv(1, heads, kv_heads, 1, keys, dim, seed=0, g=g)
        call = attend.call(q, k, v, mask, _options={"measure_memory": True})
        what = f"grouped_attention with H={heads}, H_kv={kv_heads}, S={keys}, D={dim}"
        expected = grouped_attention(q, (k, v), mask[None])
        expect_tensor(call.result, expected, what)
        assert_close(call.result, expected, name=what, rtol=1e-4, atol=1e-5)
        peaks.append(peak_allocation(call.info))
    peak, described = max(peaks)
    assert peak < repeated // 4, (
        f"with H={heads}, H_kv={kv_heads}, S={keys}, D={dim} your function's peak allocation was "
        f"{described}; K and V repeated to {heads} heads take {repeated / 2**20:.0f} MiB, either "
        f"alone {repeated / 2**21:.0f} MiB (a matmul that broadcasts K over the group copies it): "
        f"fold each group's query heads into the query rows instead (at most "
        f"{repeated / 2**22:.0f} MiB here)"
    )


def _attend(q, k, v, mask, *, scale=None, dim=-1) -> torch.Tensor:
    """Attention of q (B, H, T, D) over k, v already given per query head (B, H, S, D)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=dim).nan_to_num(0.0) @ v


def _grouped_mistakes(q, k, v, mask) -> dict:
    """grouped_attention's common mistakes on these inputs, and what each returns."""
    group = q.shape[1] // k.shape[1]
    consecutive = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    return {
        "strided groups: query head h reads KV head h % H_kv, but a group's heads are "
        "consecutive (h // G)": lambda: _attend(
            q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1), mask
        ),
        "scores not scaled by 1/√D": lambda: _attend(q, *consecutive, mask, scale=1.0),
        "the mask ignored": lambda: _attend(q, *consecutive, torch.ones_like(mask)),
        "the softmax over the query axis instead of the key axis": lambda: _attend(
            q, *consecutive, mask, dim=-2
        ),
        "K and V swapped": lambda: _attend(q, consecutive[1], consecutive[0], mask),
    }


@question(
    function="mean_pool_kv",
)
def test_mean_pool_kv(submission: Submission) -> None:
    mean_pool_kv = submission.function("mean_pool_kv")
    g, drawn = torch.Generator().manual_seed(5), submission.rng()
    new_heads, group = (int(n) for n in drawn.integers(1, 5, size=2))  # drawn afresh on every run
    random_case = (new_heads * group, new_heads, *(int(n) for n in drawn.integers(1, 9, size=2)))
    for old_heads, new_heads, dim, d_model in [
        *submission.fixed([(4, 2, 3, 5), (6, 3, 4, 7), (8, 1, 2, 3), (3, 3, 2, 4)]),
        random_case,
    ]:
        weight = torch.randn(old_heads * dim, d_model, generator=g)
        original = weight.clone()
        call = mean_pool_kv.call(weight, new_heads, dim)
        got = call.result
        expected = pool_kv_heads(original, new_heads, head_dim=dim)
        assert torch.equal(call.args[0], original), "mean_pool_kv must not modify its input"
        assert isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(expected.shape), (
            f"{old_heads} heads of D={dim} pooled to {new_heads}: expected a tensor of shape "
            f"{tuple(expected.shape)}, got {tuple(getattr(got, 'shape', ()))}"
        )
        group = old_heads // new_heads
        heads = original.view(old_heads, dim, d_model)
        mistakes = {
            "strided heads pooled (j, j + H_kv, ...): a group's heads are consecutive": lambda: (
                heads.view(group, new_heads, dim, d_model).mean(0).reshape(-1, d_model)
            ),
            "the group's sum, not its mean": lambda: expected * group,
            "the first head of each group kept, not the group's mean": lambda: heads[
                ::group
            ].reshape(-1, d_model),
        }
        with naming_mistakes(got, mistakes, rtol=1e-5, atol=1e-6):
            assert_close(
                got,
                expected,
                name=f"{old_heads} KV heads of D={dim} mean-pooled to {new_heads} (new head j is "
                f"the mean of old heads j*G' .. j*G'+G'-1, consecutive)",
                rtol=1e-5,
                atol=1e-6,
            )


_BUDGET_CONFIGS = [
    # (config, seq_len, batch_size, budget_bytes)
    (
        {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096,
         "torch_dtype": "bfloat16"},
        8192, 16, 20 * 10**9,
    ),
    (
        {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096,
         "torch_dtype": "bfloat16"},
        8192, 16, 80 * 10**9,
    ),
    (  # exactly the bytes of H_kv = 8: a budget that is met fits
        {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096,
         "torch_dtype": "bfloat16"},
        8192, 16, 8 * 2 * 32 * 128 * 2 * 8192 * 16,
    ),
    (
        {"num_hidden_layers": 30, "num_attention_heads": 9, "hidden_size": 576,
         "torch_dtype": "float32"},
        8192, 64, 10 * 10**9,
    ),
    (
        {"num_hidden_layers": 30, "num_attention_heads": 9, "hidden_size": 576,
         "torch_dtype": "float32"},
        8192, 64, 10**9,
    ),
    (
        {"num_hidden_layers": 62, "num_attention_heads": 32, "head_dim": 128, "hidden_size": 5376,
         "torch_dtype": "bfloat16"},
        32768, 4, 16 * 2**30,
    ),
]  # fmt: skip


def _kv_heads_for_budget(config, seq_len, batch_size, budget_bytes):
    heads = config["num_attention_heads"]
    fitting = [
        h
        for h in range(1, heads + 1)
        if heads % h == 0
        and kv_cache_bytes(
            {**config, "model_type": "llama", "num_key_value_heads": h},
            seq_len,
            batch_size=batch_size,
        )
        <= budget_bytes
    ]
    return max(fitting) if fitting else 0


@question(
    function="kv_heads_for_budget",
)
def test_kv_heads_for_budget(submission: Submission) -> None:
    kv_heads_for_budget = submission.function("kv_heads_for_budget")
    rng = submission.rng()
    random_cases = []
    for _ in range(3):  # drawn afresh on every run
        heads = int(rng.choice([8, 12, 16, 32, 40]))
        config = {
            "num_hidden_layers": int(rng.integers(1, 80)),
            "num_attention_heads": heads,
            "hidden_size": heads * int(rng.choice([64, 96, 128])),
            "torch_dtype": str(rng.choice(["bfloat16", "float32"])),
        }
        seq_len, batch_size = int(rng.integers(1, 32768)), int(rng.integers(1, 64))
        full = 2 * config["num_hidden_layers"] * config["hidden_size"] * seq_len * batch_size * 4
        random_cases.append((config, seq_len, batch_size, int(rng.integers(0, full))))
    for config, seq_len, batch_size, budget in [*submission.fixed(_BUDGET_CONFIGS), *random_cases]:
        expected = _kv_heads_for_budget(config, seq_len, batch_size, budget)
        got = kv_heads_for_budget(dict(config), seq_len, batch_size, budget)
        expect_int(got, "kv_heads_for_budget")
        fields = ", ".join(f"{k}={v}" for k, v in config.items())
        with naming_mistakes(got, _budget_mistakes(config, seq_len, batch_size, budget)):
            assert got == expected, (
                f"for {fields}, {batch_size} sequences of {seq_len} tokens in {budget:,} bytes: "
                f"expected H_kv = {expected} (the largest divisor of num_attention_heads that "
                f"fits; 0 if not even MQA fits), got {got}"
            )


def _budget_mistakes(config, seq_len, batch_size, budget) -> dict:
    """kv_heads_for_budget's common mistakes, and what each returns."""
    heads = config["num_attention_heads"]

    def per_kv_head(config):
        config = {**config, "model_type": "llama", "num_key_value_heads": 1}
        return kv_cache_bytes(config, seq_len, batch_size=batch_size)

    def largest(config, divisors=True):
        fitting = [h for h in range(1, heads + 1) if heads % h == 0 or not divisors]
        fitting = [h for h in fitting if h * per_kv_head(config) <= budget]
        return max(fitting, default=0)

    no_head_dim = {k: v for k, v in config.items() if k != "head_dim"}
    return {
        "the largest H_kv that fits, whether or not it divides num_attention_heads (GQA needs "
        "groups of equal size)": lambda: largest(config, divisors=False),
        "head_dim taken as hidden_size / num_attention_heads: use the config's head_dim": lambda: (
            largest(no_head_dim) if "head_dim" in config else None
        ),
    }


_RATIO_CONFIG = {  # a Llama-style model: the MHA and GQA variants differ only in H_kv
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}


@question(function="predict_mha_gqa_ratio")
def test_predict_mha_gqa_ratio(submission: Submission) -> None:
    """A prediction question: how many times larger the MHA cache is than GQA's (H=32, H_kv=8)."""
    predict = submission.function("predict_mha_gqa_ratio")
    mha, gqa = (kv_cache_bytes({**_RATIO_CONFIG, "num_key_value_heads": h}, 4096) for h in (32, 8))
    expected = mha // gqa
    got = predict()
    assert isinstance(got, (int, float, np.integer, np.floating)) and not isinstance(
        got, (bool, np.bool_)
    ), f"predict_mha_gqa_ratio should return a number, got {type(got).__name__} {got!r}"
    mistakes = {
        "GQA's cache over MHA's: the question asks MHA's over GQA's": lambda: gqa / mha,
        "H_kv itself: the ratio is H / H_kv": lambda: 8,
        "the group size squared": lambda: (32 // 8) ** 2,
        "H itself: the ratio is H / H_kv": lambda: 32,
    }
    with naming_mistakes(got, mistakes):
        assert got == expected, (
            f"with H=32 query heads, MHA caches 32 K/V heads ({mha:,} bytes for 4096 tokens) and "
            f"GQA with H_kv=8 caches 8 ({gqa:,} bytes): MHA's is {expected} times larger; you "
            f"predicted {got!r}"
        )
