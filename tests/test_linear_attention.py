"""Gated linear attention (`kvlib.layers.linear_attention`, chapter 17) against its oracles: a
brute-force double loop over (i, j) with the decay written as a product of the a_l, and, with no
decay, causal linear attention as a running sum of outer products (Katharopoulos et al., 2020).
The parallel, recurrent and chunked forms agree with each other and with these; a prompt split in
two with the state carried equals one pass; decode after a chunked prefill equals the parallel
form over everything; -inf decays reset; the state's bytes stay constant; snapshots restore only
at their own position; every validation error names its argument.

Tolerances: in float64 the forms add the same products in different orders and form the decays
as exp(sum) (parallel, chunked) or as a running product of exp (recurrent): round-off of order
1e-15 on outputs of order 10, checked to 1e-10. In float32 the same reorderings cost about
T · 6e-8 relative to sums of terms of order |q||k||v| ≈ 10 (D_k = 5): about 1e-5 at T = 64, so
float32 results are checked against the float64 parallel form to atol = rtol = 1e-4.
"""

import math

import numpy as np
import pytest
import torch

from kvlib.layers.linear_attention import (
    RecurrentStateCache,
    StateSnapshot,
    chunked_form,
    decay_matrix,
    parallel_form,
    recurrent_form,
)
from kvlib.testing import assert_close

FLOAT64 = {"rtol": 1e-10, "atol": 1e-10}
FLOAT32 = {"rtol": 1e-4, "atol": 1e-4}
B, H, D_K, D_V = 2, 3, 5, 4


def inputs(num_tokens, *, seed=0, dtype=torch.float64, max_decay=0.5):
    """q, k (B, H, T, D_k), v (B, H, T, D_v), log_decay (B, H, T) in [-max_decay, 0]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, num_tokens, D_K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, num_tokens, D_K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, num_tokens, D_V, generator=gen, dtype=torch.float64)
    log_decay = -max_decay * torch.rand(B, H, num_tokens, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, log_decay))


def brute_force(q, k, v, log_decay):
    """o_i = Σ_{j<=i} (a_{j+1} · ... · a_i) (q_i · k_j) v_j, one (i, j) pair at a time."""
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    decay = log_decay.exp()
    for i in range(q.shape[2]):
        for j in range(i + 1):
            product = torch.ones(q.shape[:2], dtype=q.dtype)  # (B, H)
            for step in range(j + 1, i + 1):
                product = product * decay[:, :, step]
            score = (q[:, :, i] * k[:, :, j]).sum(-1)  # (B, H)
            out[:, :, i] += (product * score)[..., None] * v[:, :, j]
    return out


@pytest.mark.parametrize("num_tokens", [1, 2, 16, 37])
@pytest.mark.parametrize("chunk", [1, 3, 5, "T"])
def test_the_three_forms_agree_in_float64(num_tokens, chunk):
    q, k, v, log_decay = inputs(num_tokens)
    chunk_size = num_tokens if chunk == "T" else chunk  # 3 and 5 divide none of 2, 16, 37
    expected = parallel_form(q, k, v, log_decay)
    out_recurrent, state_recurrent = recurrent_form(q, k, v, log_decay)
    out_chunked, state_chunked = chunked_form(q, k, v, log_decay, chunk_size)
    assert_close(out_recurrent, expected, name="recurrent out", **FLOAT64)
    assert_close(out_chunked, expected, name="chunked out", **FLOAT64)
    assert_close(state_chunked, state_recurrent, name="chunked state", **FLOAT64)


@pytest.mark.parametrize("num_tokens", [1, 6, 13])
def test_the_parallel_form_equals_the_brute_force_sum(num_tokens):
    q, k, v, log_decay = inputs(num_tokens, seed=1)
    assert_close(parallel_form(q, k, v, log_decay), brute_force(q, k, v, log_decay), **FLOAT64)


def test_float32_forms_stay_within_the_stated_tolerance_of_float64():
    exact = parallel_form(*inputs(64, seed=2))
    q, k, v, log_decay = inputs(64, seed=2, dtype=torch.float32)
    assert parallel_form(q, k, v, log_decay).dtype == torch.float32
    assert_close(parallel_form(q, k, v, log_decay), exact, name="parallel", **FLOAT32)
    assert_close(recurrent_form(q, k, v, log_decay)[0], exact, name="recurrent", **FLOAT32)
    assert_close(chunked_form(q, k, v, log_decay, 7)[0], exact, name="chunked", **FLOAT32)


def test_without_decay_it_is_causal_linear_attention():
    q, k, v, _ = inputs(19, seed=3)
    no_decay = torch.zeros(B, H, 19, dtype=torch.float64)
    states = torch.cumsum(k[..., :, None] * v[..., None, :], dim=2)  # (B, H, T, D_k, D_v)
    expected = torch.einsum("bhtk,bhtkv->bhtv", q, states)
    assert_close(parallel_form(q, k, v, no_decay), expected, name="parallel", **FLOAT64)
    assert_close(recurrent_form(q, k, v, no_decay)[0], expected, name="recurrent", **FLOAT64)
    assert_close(chunked_form(q, k, v, no_decay, 4)[0], expected, name="chunked", **FLOAT64)


@pytest.mark.parametrize("split", [1, 7, 20, 28])
def test_a_prompt_in_two_parts_with_the_state_carried_equals_one_pass(split):
    q, k, v, log_decay = inputs(29, seed=4)
    whole, whole_state = chunked_form(q, k, v, log_decay, 4)
    first, second = slice(0, split), slice(split, None)
    out_1, state = chunked_form(q[:, :, first], k[:, :, first], v[:, :, first],
                                log_decay[:, :, first], 4)  # fmt: skip
    out_2, state = chunked_form(q[:, :, second], k[:, :, second], v[:, :, second],
                                log_decay[:, :, second], 3, state)  # fmt: skip
    assert_close(torch.cat([out_1, out_2], dim=2), whole, name="outputs", **FLOAT64)
    assert_close(state, whole_state, name="state", **FLOAT64)
    fresh, _ = chunked_form(q[:, :, second], k[:, :, second], v[:, :, second],
                            log_decay[:, :, second], 3)  # fmt: skip
    assert (fresh - out_2).abs().max() > 1e-3, "the carried state changed nothing"


def test_decode_after_a_chunked_prefill_equals_the_parallel_form():
    prompt, generated = 13, 9
    q, k, v, log_decay = inputs(prompt + generated, seed=5)
    expected = parallel_form(q, k, v, log_decay)
    cut = slice(0, prompt)
    out, state = chunked_form(q[:, :, cut], k[:, :, cut], v[:, :, cut], log_decay[:, :, cut], 4)
    outputs = [out]
    for t in range(prompt, prompt + generated):
        step = slice(t, t + 1)
        out, state = recurrent_form(q[:, :, step], k[:, :, step], v[:, :, step],
                                    log_decay[:, :, step], state)  # fmt: skip
        outputs.append(out)
    assert_close(torch.cat(outputs, dim=2), expected, **FLOAT64)


def test_a_minus_infinity_decay_resets_the_state():
    q, k, v, log_decay = inputs(23, seed=6)
    log_decay[:, :, 10] = -math.inf  # a_10 = 0: tokens before 10 are forgotten
    suffix = slice(10, None)
    expected = parallel_form(q[:, :, suffix], k[:, :, suffix], v[:, :, suffix],
                             log_decay[:, :, suffix])  # fmt: skip
    for name, out in [
        ("parallel", parallel_form(q, k, v, log_decay)),
        ("recurrent", recurrent_form(q, k, v, log_decay)[0]),
        ("chunked", chunked_form(q, k, v, log_decay, 4)[0]),
    ]:
        assert torch.isfinite(out).all(), name
        assert_close(out[:, :, suffix], expected, name=name, **FLOAT64)


def test_the_decay_matrix_is_exact_where_cumulative_sums_would_cancel():
    """With cumulative log decays near -2500, exp(c_i - c_{i-1}) in float32 loses about 1e-4 of
    relative precision (the spacing of floats near 2500 is 2.4e-4); a sum of one term loses none."""
    gen = torch.Generator().manual_seed(7)
    log_decay = -80 * torch.rand(64, generator=gen)  # float32
    gamma = decay_matrix(log_decay)  # (T, T)
    assert torch.equal(gamma.diagonal(), torch.ones(64))
    assert torch.equal(gamma.triu(1), torch.zeros(64, 64))
    assert_close(gamma.diagonal(-1), log_decay[1:].exp(), rtol=1e-6, atol=0)
    reset = decay_matrix(torch.tensor([0.0, -math.inf, -1.0]))
    assert_close(reset, torch.tensor([[1, 0, 0], [0, 1, 0], [0, math.exp(-1), 1]]), atol=0)


def prefill_and_decode(cache, inputs_per_layer, prompt, steps):
    """Run `cache` over layers' inputs: a prefill of `prompt` tokens, then `steps` decode steps.
    Returns each layer's outputs (B, H, prompt + steps, D_v) and the nbytes after each forward."""
    outputs, sizes = [[] for _ in inputs_per_layer], []
    for part in [slice(0, prompt)] + [slice(t, t + 1) for t in range(prompt, prompt + steps)]:
        for layer, tensors in enumerate(inputs_per_layer):
            outputs[layer].append(cache.update(layer, *(x[:, :, part] for x in tensors)))
        cache.advance(part.stop - part.start)
        sizes.append(cache.nbytes)
    return [torch.cat(out, dim=2) for out in outputs], sizes


def test_the_cache_matches_the_parallel_form_and_its_bytes_stay_constant():
    layers = [inputs(48, seed=8), inputs(48, seed=9)]
    cache = RecurrentStateCache(num_layers=2, chunk_size=5)
    outputs, sizes = prefill_and_decode(cache, layers, prompt=8, steps=40)
    for layer, tensors in enumerate(layers):
        assert_close(outputs[layer], parallel_form(*tensors), name=f"layer {layer}", **FLOAT64)
    assert cache.length == 48
    assert sizes == [2 * B * H * D_K * D_V * 8] * 41  # L · B · H · D_k · D_v · b, every step


def test_a_snapshot_restores_the_states_it_copied():
    layers = [inputs(24, seed=10), inputs(24, seed=11)]
    cache = RecurrentStateCache(num_layers=2, chunk_size=4)
    prefill_and_decode(cache, [tuple(x[:, :, :16] for x in t) for t in layers], 16, 0)
    snapshot = cache.snapshot()
    kept = [s.clone() for s in snapshot.states]
    first, _ = prefill_and_decode(cache, [tuple(x[:, :, 16:] for x in t) for t in layers], 8, 0)
    assert all(torch.equal(s, c) for s, c in zip(snapshot.states, kept)), "snapshot aliased"
    for _ in range(2):  # a snapshot serves more than one restore
        cache.restore(snapshot, position=16)
        assert cache.length == 16
        again, _ = prefill_and_decode(cache, [tuple(x[:, :, 16:] for x in t) for t in layers], 8, 0)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_a_mid_block_snapshot_cannot_serve_a_prefix_hit_at_the_block_boundary():
    """Request A's prompt (20 tokens) ends inside its second block of 16; request B shares A's
    first block only. A's state at 20 is not B's state at 16: restoring it is refused, and using
    it anyway (through the functions) gives wrong outputs; a snapshot at 16 gives the right ones."""
    block_size = 16
    a = inputs(20, seed=12)
    b = tuple(torch.cat([x[:, :, :block_size], y[:, :, block_size:]], dim=2)
              for x, y in zip(a, inputs(27, seed=13)))  # fmt: skip
    cache = RecurrentStateCache(num_layers=1, chunk_size=8)
    prefill_and_decode(cache, [tuple(x[:, :, :block_size] for x in a)], block_size, 0)
    at_boundary = cache.snapshot()
    prefill_and_decode(cache, [tuple(x[:, :, block_size:] for x in a)], 4, 0)
    mid_block = cache.snapshot()
    assert mid_block.position == 20
    with pytest.raises(ValueError, match="position: expected 20.*got 16"):
        cache.restore(mid_block, position=block_size)

    rest = tuple(x[:, :, block_size:] for x in b)
    expected = parallel_form(*b)[:, :, block_size:]
    wrong, _ = chunked_form(*rest, 8, mid_block.states[0])
    assert (wrong - expected).abs().max() > 0.1, "the mid-block state happened to be right"
    cache.restore(at_boundary, position=block_size)
    assert_close(cache.update(0, *rest), expected, **FLOAT64)


def bad_inputs():
    """(name, keyword overrides of inputs(5), exception, message fragment)."""
    q, k, v, log_decay = inputs(5)
    positive = log_decay.clone()
    positive[0, 1, 2] = 0.5
    return [
        ("q numpy", {"q": q.numpy()}, TypeError, "q: expected a floating-point torch.Tensor"),
        ("k int", {"k": k.long()}, TypeError, "k: expected a floating-point"),
        ("v float32", {"v": v.float()}, TypeError, "v: expected q's dtype torch.float64"),
        ("k meta", {"k": k.to("meta")}, ValueError, "k: expected q's device cpu"),
        ("q 3-D", {"q": q[0]}, ValueError, r"q: expected \(B, H, T, D_k\)"),
        ("T = 0", {"q": q[:, :, :0]}, ValueError, "T >= 1"),
        ("k D_k", {"k": k[..., :3]}, ValueError, r"k: expected .* = \(2, 3, 5, 5\)"),
        ("v 3-D", {"v": v[0]}, ValueError, r"v: expected \(B, H, T, D_v\)"),
        ("v T", {"v": v[:, :, :4]}, ValueError, r"v: expected .* = \(2, 3, 5, 4\)"),
        ("log_decay shape", {"log_decay": log_decay[0]}, ValueError, r"log_decay: expected \("),
        ("log_decay > 0", {"log_decay": positive}, ValueError, "values <= 0.*got 0.5"),
        ("log_decay nan", {"log_decay": log_decay * math.nan}, ValueError, "<= 0.*got nan"),
    ]


@pytest.mark.parametrize("form", ["parallel", "recurrent", "chunked"])
@pytest.mark.parametrize("case", bad_inputs(), ids=lambda case: case[0])
def test_bad_inputs_are_refused_naming_the_argument(form, case):
    _, overrides, error, message = case
    q, k, v, log_decay = inputs(5)
    arguments = {"q": q, "k": k, "v": v, "log_decay": log_decay, **overrides}
    call = {
        "parallel": parallel_form,
        "recurrent": recurrent_form,
        "chunked": lambda **kw: chunked_form(**kw, chunk_size=2),
    }[form]
    with pytest.raises(error, match=message):
        call(**arguments)


@pytest.mark.parametrize("form", [recurrent_form, lambda *a, **kw: chunked_form(*a, 2, **kw)])
def test_a_bad_state_is_refused(form):
    q, k, v, log_decay = inputs(5)
    with pytest.raises(ValueError, match=r"state: expected .* = \(2, 3, 5, 4\), got \(2, 3, 4, 5"):
        form(q, k, v, log_decay, state=torch.zeros(B, H, D_V, D_K, dtype=torch.float64))
    with pytest.raises(TypeError, match="state: expected q's dtype"):
        form(q, k, v, log_decay, state=torch.zeros(B, H, D_K, D_V))


def test_bad_chunk_sizes_layers_and_snapshots_are_refused():
    q, k, v, log_decay = inputs(5)
    with pytest.raises(ValueError, match="chunk_size: expected an int >= 1, got 0"):
        chunked_form(q, k, v, log_decay, 0)
    with pytest.raises(TypeError, match="chunk_size: expected an int"):
        chunked_form(q, k, v, log_decay, 2.0)
    with pytest.raises(ValueError, match="num_layers"):
        RecurrentStateCache(0)
    cache = RecurrentStateCache(2)
    for layer_idx in (2, -1, True, 1.0):
        with pytest.raises(ValueError, match=r"layer_idx: expected an int in \[0, 2\)"):
            cache.update(layer_idx, q, k, v, log_decay)
    with pytest.raises(TypeError, match="snapshot: expected a StateSnapshot, got tuple"):
        cache.restore((0, (None, None)), position=0)
    with pytest.raises(ValueError, match="snapshot: expected 2 layers' states, got 1"):
        cache.restore(StateSnapshot(0, (None,)), position=0)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.advance(0)


def test_numpy_is_not_silently_converted():
    q, k, v, log_decay = inputs(3)
    with pytest.raises(TypeError, match="log_decay"):
        parallel_form(q, k, v, np.zeros((B, H, 3)))
