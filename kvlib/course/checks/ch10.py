"""Chapter 10's graded questions: asymmetric int4 quantization with packing, KIVI's per-channel key
scales over groups of tokens, and a quantized cache's bytes per token with its scales. Oracle:
`kvlib.quant`."""

from __future__ import annotations

import numpy as np
import torch

from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Submission, question
from kvlib.quant import QuantScheme, quantize, unpack_bits


def _rows(seed: int, drawn, fixed: bool = True) -> list[tuple[torch.Tensor, str]]:
    """Fixed cases (if `fixed`), and rows drawn from `drawn` (a numpy Generator, drawn afresh on
    every run)."""
    g = torch.Generator().manual_seed(seed)
    n, d = int(drawn.integers(1, 7)), 2 * int(drawn.integers(1, 17))
    magnitude, offset = float(10 ** drawn.uniform(-2, 3)), float(drawn.normal() * 100)
    random_rows = torch.from_numpy(drawn.normal(size=(n, d)) * magnitude + offset).float()
    outlier = torch.randn(6, 16, generator=g)
    outlier[:, 3] *= 40
    constant = torch.randn(4, 8, generator=g)
    constant[1] = 0.0
    constant[2] = 1.5
    cases = [
        (torch.randn(5, 8, generator=g), "random rows of 8"),
        (torch.rand(3, 32, generator=g) + 2.0, "all-positive rows (min far from 0)"),
        (outlier, "rows with an outlier channel"),
        (constant, "rows whose max equals their min (all 0, all 1.5)"),
    ]
    random_case = (random_rows, f"random ({n}, {d}) rows ~{magnitude:.3g} around {offset:.3g}")
    return [*(cases if fixed else []), random_case]


@question(
    function="quantize_int4",
)
def test_quantize_int4(submission: Submission) -> None:
    quantize_int4 = submission.function("quantize_int4")
    for x, what in _rows(10, submission.rng(), submission.fixed_cases):
        result = quantize_int4(x.clone())
        assert isinstance(result, tuple) and len(result) == 3, (
            f"quantize_int4 should return (packed, scale, zero), got {type(result).__name__}"
        )
        packed, scale, zero = result
        n, d = x.shape
        assert isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8, (
            f"packed: expected a uint8 tensor, got {getattr(packed, 'dtype', type(packed))}"
        )
        assert packed.shape == (n, d // 2), (
            f"{what}: packed should be (N, D / 2) = {(n, d // 2)}: two 4-bit codes per byte, got "
            f"{tuple(packed.shape)}"
        )
        scale, zero = torch.as_tensor(scale).float(), torch.as_tensor(zero).float()
        assert scale.shape == (n, 1) and zero.shape == (n, 1), (
            f"scale, zero: expected (N, 1) each (one per token), got {tuple(scale.shape)} and "
            f"{tuple(zero.shape)}"
        )
        assert (torch.isfinite(scale) & (scale > 0)).all() and torch.isfinite(zero).all(), (
            f"{what}: a row whose max equals its min has range 0; a scale of 0 divides 0 by 0. "
            "Give such rows any positive scale (codes 0, x̂ = zero)"
        )
        levels = unpack_bits(packed, 4).float()
        x_hat = levels * scale + zero
        named = naming_mistakes(x_hat, _int4_mistakes(x), rtol=1e-5, atol=1e-5,
                                expected=_int4_variant(x))  # fmt: skip
        with named:
            _check_int4_values(x, x_hat, levels, scale, zero, what)


def _int4_variant(x, *, levels=15, rounding=torch.round, high_nibble_first=False):
    """x (N, D) quantized to 4 bits per row (zero = the row's minimum) and dequantized: the right
    answer, or one of `_int4_mistakes`' (a row of range 0 gets scale 1, codes 0)."""
    low = x.amin(dim=1, keepdim=True)
    span = x.amax(dim=1, keepdim=True) - low
    scale = torch.where(span > 0, span / levels, torch.ones_like(span))
    codes = rounding((x - low) / scale).clamp(0, 15)
    if high_nibble_first:  # the pair's first code in bits 4-7: unpacked low-first, swapped
        codes = codes.view(x.shape[0], -1, 2).flip(-1).reshape(x.shape)
    return codes * scale + low


def _int4_mistakes(x) -> dict:
    """quantize_int4's common mistakes, as the dequantized values they give."""
    return {
        "the codes packed high nibble first (the first of each pair belongs in bits 0-3)": (
            lambda: _int4_variant(x, high_nibble_first=True)
        ),
        "scale = (max - min) / 16: 4 bits give 16 codes but 15 steps between them": (
            lambda: _int4_variant(x, levels=16)
        ),
        "the codes truncated (floor) instead of rounded to the nearest": (
            lambda: _int4_variant(x, rounding=torch.floor)
        ),
    }


def _check_int4_values(x, x_hat, levels, scale, zero, what) -> None:
    """The dequantized values' checks (zero, error within scale / 2, all 16 levels used)."""
    low = x.amin(dim=1, keepdim=True)
    assert (zero - low).abs().max() <= 1e-6 * (1 + low.abs().max()), (
        f"{what}: asymmetric: zero = the row's minimum (x̂ = scale · q + zero), got zero "
        f"{zero[:3, 0].tolist()} for minima {low[:3, 0].tolist()}"
    )
    error = (x - x_hat).abs()
    allowed = scale / 2 + 1e-5 * (x.abs() + zero.abs() + 1)
    assert torch.isfinite(x_hat).all() and (error <= allowed).all(), (
        f"{what}: unpacking low nibble first (the first code of each pair in bits 0-3) and "
        "computing scale · q + zero should be within scale / 2 of x; the largest error was "
        f"{float(error.max()):.3g} (check the nibble order, the rounding, and scale = "
        "(max - min) / 15)"
    )
    span = x.amax(dim=1) - x.amin(dim=1)
    varied = span > 0
    assert (levels[varied].amax(dim=1) == 15).all(), (
        f"{what}: each row's maximum should get code 15 (scale = (max - min) / 15 uses all "
        "16 levels)"
    )


def _keys(seed: int, drawn, fixed: bool = True) -> list[tuple[torch.Tensor, int, str]]:
    """Fixed cases (if `fixed`), and keys drawn from `drawn` (a numpy Generator, drawn afresh on
    every run)."""
    g = torch.Generator().manual_seed(seed)
    group, groups, channels = (int(n) for n in drawn.integers(1, (33, 5, 5)) * (1, 1, 4))
    random_keys = drawn.normal(size=(group * groups, channels)) * 10 ** drawn.uniform(
        -1, 2, channels
    )
    keys = torch.randn(64, 16, generator=g)
    keys[:, 5] *= 30
    ramp = torch.arange(96, dtype=torch.float32)[:, None] * torch.ones(1, 4)
    flat = torch.randn(32, 8, generator=g)
    flat[:16, 2] = 0.5  # channel 2 is constant in the first group: its range is 0
    cases = [
        (keys[:48], 8, "48 tokens x 16 channels with an outlier channel, G = 8"),
        (keys, 32, "64 tokens, G = 32"),
        (ramp, 32, "a ramp: token t holds t in every channel, G = 32"),
        (torch.randn(16, 8, generator=g), 16, "one group"),
        (flat, 16, "a channel constant over a group (range 0)"),
        (torch.randn(6, 4, generator=g), 1, "groups of one token (every range 0)"),
    ]
    random_case = (torch.from_numpy(random_keys).float(), group, f"random: {groups} groups of G "
                   f"= {group}")  # fmt: skip
    return [*(cases if fixed else []), random_case]


@question(function="kivi_key_scales")
def test_kivi_key_scales(submission: Submission) -> None:
    kivi_key_scales = submission.function("kivi_key_scales")
    for keys, group, what in _keys(11, submission.rng(), submission.fixed_cases):
        oracle = quantize(keys, QuantScheme("int2", False, "tokens", group, torch.float32))
        result = kivi_key_scales(keys.clone(), group)
        assert isinstance(result, tuple) and len(result) == 2, (
            f"kivi_key_scales should return (scale, zero), got {type(result).__name__}"
        )
        scale, zero = (torch.as_tensor(t).float() for t in result)
        expected_shape = (keys.shape[0] // group, keys.shape[1])
        mistakes = _kivi_mistakes(keys, group)
        with naming_mistakes((scale, zero), mistakes, rtol=1e-5, atol=1e-6):
            assert scale.shape == expected_shape and zero.shape == expected_shape, (
                f"{what}: one scale and zero per channel per group of G tokens: expected "
                f"{expected_shape} each (S / G, D), got {tuple(scale.shape)} and "
                f"{tuple(zero.shape)}"
            )
        grouped = keys.view(-1, group, keys.shape[1])  # (S / G, G, D)
        flat = grouped.amax(dim=1) == grouped.amin(dim=1)  # range 0: any scale >= 0 will do
        assert bool((torch.isfinite(scale[flat]) & (scale[flat] >= 0)).all()), (
            f"{what}: where a channel's group has max = min (range 0), the scale may be anything "
            f">= 0 ((max - min) / 3 = 0 is fine, and so is kvlib's 1), got "
            f"{scale[flat][:4].tolist()}"
        )
        ok = torch.allclose(zero, oracle.zero, rtol=1e-5, atol=1e-6) and torch.allclose(
            scale[~flat], oracle.scale[~flat], rtol=1e-5, atol=1e-6
        )
        varied = {  # the scales where the range is not 0 (elsewhere any scale >= 0 will do)
            mistake: lambda answer=answer: _where_varied(*answer(), flat)
            for mistake, answer in mistakes.items()
        }
        right = (oracle.scale[~flat], oracle.zero)
        with naming_mistakes((scale[~flat], zero), varied, rtol=1e-5, atol=1e-6, expected=right):
            assert ok, (
                f"{what}: per-channel means the min and max run over groups of G consecutive "
                "tokens (rows 0..G-1, G..2G-1, ...), separately for each channel; zero = that "
                "min, scale = (max - min) / 3 for 2 bits; first group expected zero "
                f"{oracle.zero[0, :4].tolist()} scale {oracle.scale[0, :4].tolist()}, got "
                f"{zero[0, :4].tolist()} and {scale[0, :4].tolist()}"
            )


def _where_varied(scale, zero, flat):
    """The scales where a group's range is not 0, and every zero."""
    return scale[~flat], zero


def _kivi_mistakes(keys: torch.Tensor, group: int) -> dict:
    """kivi_key_scales's common mistakes, each as (scale, zero); the first from the chapter's
    pitfall 2 (per-token key scales)."""
    s, d = keys.shape
    grouped = keys.view(s // group, group, d)  # (S / G, G, D): consecutive tokens
    low, high = grouped.amin(dim=1), grouped.amax(dim=1)
    strided = keys.view(group, s // group, d)  # group j: tokens j, j + S / G, ...
    return {
        "per-token scales (the min and max over each token's channels): KIVI's key scales are "
        "per channel": lambda: (
            (grouped.amax(dim=2) - grouped.amin(dim=2)) / 3,
            grouped.amin(dim=2),
        ),
        "scale = (max - min) / 4: 2 bits give 4 levels, 3 steps apart, so divide by 3": lambda: (
            (high - low) / 4,
            low,
        ),
        "strided groups (tokens j, j + S/G, ...): a group is G consecutive tokens": lambda: (
            (strided.amax(dim=0) - strided.amin(dim=0)) / 3,
            strided.amin(dim=0),
        ),
    }


@question(function="bytes_per_token")
def test_bytes_per_token(submission: Submission) -> None:
    bytes_per_token = submission.function("bytes_per_token")
    cases = submission.fixed([
        (32, 8, 128, 2, 32, 2, "Llama 3 8B, 2-bit KIVI, fp16 scales"),
        (30, 3, 64, 4, 32, 2, "SmolLM2, 4-bit KIVI"),
        (4, 4, 32, 8, 32, 4, "the course model, 8 bits, fp32 scales"),
        (2, 1, 64, 2, 16, 2, "groups of 16"),
    ])  # fmt: skip
    drawn = submission.rng()
    for _ in range(3):  # drawn afresh on every run
        group = int(drawn.choice([16, 32, 64, 128]))
        cases.append((int(drawn.integers(1, 100)), int(drawn.integers(1, 17)),
                      group * int(drawn.integers(1, 3)), int(drawn.choice([2, 4, 8])), group,
                      int(drawn.choice([2, 4])), "random"))  # fmt: skip
    for layers, heads, head_dim, bits, group, scale_bytes, what in cases:
        dtype = {2: torch.float16, 4: torch.float32}[scale_bytes]
        key = QuantScheme(f"int{bits}", False, "tokens", group, dtype)
        value = QuantScheme(f"int{bits}", False, "channels", group, dtype)
        codes = head_dim * bits / 8  # one vector's codes
        decoders = head_dim / group * 2 * scale_bytes  # its share of (scale, zero) pairs
        expected = layers * heads * 2 * (codes + decoders)
        assert expected == layers * heads * (
            key.bytes_per_vector(head_dim) + value.bytes_per_vector(head_dim)
        )
        got = bytes_per_token(layers, heads, head_dim, bits, group, scale_bytes)
        assert isinstance(got, (int, float, np.integer, np.floating)) and not isinstance(
            got, (bool, np.bool_)
        ), f"bytes_per_token should return a number, got {type(got).__name__}"
        per_vectors = layers * heads * 2
        mistakes = {
            "bits counted as bytes: a code of `bits` bits takes bits / 8 bytes": lambda: (
                per_vectors * (head_dim * bits + decoders)
            ),
            "the codes only: each group's scale and zero point are stored too": lambda: (
                per_vectors * codes
            ),
            "a scale per group but no zero point (asymmetric quantization stores both)": lambda: (
                per_vectors * (codes + decoders / 2)
            ),
            "one (scale, zero) pair per vector, not one per group of G": lambda: (
                per_vectors * (codes + 2 * scale_bytes)
            ),
            "keys only: values are cached (and quantized) too": lambda: expected / 2,
            "one layer: every layer has its own cache": lambda: expected / layers,
        }
        with naming_mistakes(float(got), mistakes, rtol=0.0, atol=1e-6):
            assert abs(got - expected) < 1e-6, (
                f"{what}: per layer and KV head, a key and a value of D codes at `bits` bits, "
                "plus, per group of G, a scale and a zero point (asymmetric) of scale_bytes each, "
                f"for keys and for values; expected {expected:g} bytes, got {got:g}"
            )
