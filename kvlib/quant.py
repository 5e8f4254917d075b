"""Quantizing keys and values: integer and fp8 formats, scales per tensor, token, channel or group
(chapter 10).

**Granularity, said once.** A scale is shared by the elements a min/max is reduced over. A K or V
tensor here is `(..., S, D)`: tokens on the second-to-last axis, channels (the D elements of one
head's vector) on the last. `QuantScheme.reduce` names the axis reduced:

- `reduce="channels"`: the min/max runs over a token's D channels: one scale per token (and head),
  what papers call **per-token** quantization;
- `reduce="tokens"`: the min/max runs over the tokens, channel by channel: one scale per channel,
  **per-channel** quantization (KIVI's keys);
- `reduce="all"`: one scale for the whole tensor, **per-tensor** (vLLM's fp8 cache scale).

`group_size` splits the reduced axis into groups of that many elements, each with its own scale
(**per-group**): per-token in groups of 32 channels, or per-channel over groups of 32 tokens (KIVI,
Liu et al., 2024, ICML). Libraries disagree on what "axis" and "per-channel" mean (quanto's `axis`
names the axis *kept*); `reduce` names the one *reduced*, so there is nothing to flip.

**Formats.**
- `int8`, `int4`, `int2`: `b`-bit integers. Symmetric: codes in `[-(2^(b-1) - 1), 2^(b-1) - 1]`,
  `x̂ = s · q`, `s = max|x| / (2^(b-1) - 1)` (int2 symmetric has only the three levels -1, 0, 1).
  Asymmetric: codes in `[0, 2^b - 1]`, `x̂ = s · q + z`, `z = min x`, `s = (max x - min x) /
  (2^b - 1)`. int4 and int2 codes are packed along the last axis, low bits first (two or four per
  byte), as unsigned levels (symmetric codes offset by `2^(b-1)`).
- `fp8_e4m3fn` (max 448), `fp8_e5m2` (max 57,344), `fp8_e4m3fnuz` (max 240, the variant AMD's MI300
  computes in): symmetric only, `s = max|x| / max_format`, codes `x / s` cast to the format
  (round to nearest even), `x̂ = s · code` (Micikevicius et al., 2022, "FP8 formats for deep
  learning").

**Scales** are stored in `scale_dtype` (float16 by default, as KIVI and transformers store them),
rounded *up* to that dtype, and zero points rounded *down*, so no value leaves the code range and
the round-trip bounds below hold with the stored numbers:

- integers: `|x - x̂| <= s / 2` per element (half a step of its group);
- fp8: `|x - x̂| <= s · max(|x / s| · 2^-(m+1), 2^(e_min - m - 1))` with `m` mantissa bits and
  `e_min` the smallest normal exponent (half a unit in the last place, or half the subnormal
  spacing).

`round_trip_bound` returns these per element (plus fp32 arithmetic slack); the tests check every
scheme against them in float64.

A group whose max equals its min (a channel that is constant over the group, all zeros at the
start of a sequence) has range 0: the scale would be 0 and `(x - z) / s` a 0/0. Here a zero
scale is replaced by 1 (every code 0, `x̂ = z`), so nothing divides by zero; chapter 10 shows the
NaN the naive division makes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = [
    "FORMATS",
    "QuantFormat",
    "QuantScheme",
    "QuantizedTensor",
    "cat_quantized",
    "dequantize",
    "pack_bits",
    "quantize",
    "round_trip_bound",
    "unpack_bits",
]


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A storage format: `bits` per element; `dtype` the torch dtype of fp8 codes (None for
    integers); for fp8, `max` (largest finite value), `mantissa_bits` and `min_normal_exp`."""

    name: str
    bits: int
    dtype: torch.dtype | None = None
    max: float | None = None
    mantissa_bits: int | None = None
    min_normal_exp: int | None = None

    @property
    def is_float(self) -> bool:
        return self.dtype is not None


def _fp8(name: str, dtype: torch.dtype, mantissa_bits: int) -> QuantFormat:
    info = torch.finfo(dtype)
    return QuantFormat(
        name, 8, dtype, float(info.max), mantissa_bits, int(math.log2(info.smallest_normal))
    )


FORMATS = {
    "int8": QuantFormat("int8", 8),
    "int4": QuantFormat("int4", 4),
    "int2": QuantFormat("int2", 2),
    "fp8_e4m3fn": _fp8("fp8_e4m3fn", torch.float8_e4m3fn, 3),
    "fp8_e5m2": _fp8("fp8_e5m2", torch.float8_e5m2, 2),
    "fp8_e4m3fnuz": _fp8("fp8_e4m3fnuz", torch.float8_e4m3fnuz, 3),
}
REDUCE_AXES = {"channels": -1, "tokens": -2, "all": None}
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How a K or V tensor `(..., S, D)` is quantized (see the module docstring).

    Args:
        format: a key of `FORMATS` ("int8", "int4", "int2", "fp8_e4m3fn", "fp8_e5m2",
            "fp8_e4m3fnuz").
        symmetric: True: `x̂ = s · q`; False: `x̂ = s · q + z` (integers only).
        reduce: the axis a scale's min/max runs over: "channels" (per token), "tokens" (per
            channel) or "all" (per tensor).
        group_size: elements of the reduced axis per scale; None: the whole axis.
        scale_dtype: dtype of the stored scales and zero points.

    Raises:
        ValueError: an unknown format or reduce axis, asymmetric fp8, a group size that is not a
        positive int or is given with reduce="all". TypeError: a scale dtype other than float16,
        bfloat16 or float32.
    """

    format: str
    symmetric: bool = True
    reduce: str = "channels"
    group_size: int | None = None
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"format: expected one of {sorted(FORMATS)}, got {self.format!r}")
        if self.reduce not in REDUCE_AXES:
            raise ValueError(
                f"reduce: expected 'channels' (per-token scales), 'tokens' (per-channel) or "
                f"'all' (per-tensor), got {self.reduce!r}"
            )
        if self.fmt.is_float and not self.symmetric:
            raise ValueError(f"symmetric: {self.format} is symmetric only (no zero point)")
        if self.group_size is not None and (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size < 1
            or self.reduce == "all"
        ):
            raise ValueError(
                "group_size: expected None or a positive int (and None with reduce='all'), got "
                f"{self.group_size!r}"
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise TypeError(
                f"scale_dtype: expected one of {SCALE_DTYPES}, got {self.scale_dtype!r}"
            )

    @property
    def fmt(self) -> QuantFormat:
        return FORMATS[self.format]

    @property
    def bits(self) -> int:
        return self.fmt.bits

    @property
    def granularity(self) -> str:
        """'per-token', 'per-channel' or 'per-tensor', with the group if there is one."""
        name = {"channels": "per-token", "tokens": "per-channel", "all": "per-tensor"}[self.reduce]
        if self.group_size is None:
            return name
        unit = "channels" if self.reduce == "channels" else "tokens"
        return f"{name}, groups of {self.group_size} {unit}"

    def label(self) -> str:
        """A short name: 'int4 asym per-channel/G32'."""
        group = "" if self.group_size is None else f"/G{self.group_size}"
        kind = "" if self.fmt.is_float else (" sym" if self.symmetric else " asym")
        return f"{self.format}{kind} {self.granularity.split(',')[0]}{group}"

    def scales_per_vector(self, head_dim: int) -> float:
        """Scales one token's D-vector carries, amortized: D / g per token with groups of g
        channels (1 without groups); D / G with per-channel scales over groups of G tokens (0
        when a whole unbounded axis shares them, as per-tensor: counted as 0 per token)."""
        if self.reduce == "channels":
            return head_dim / (self.group_size or head_dim)
        if self.reduce == "tokens" and self.group_size is not None:
            return head_dim / self.group_size
        return 0.0

    def bytes_per_vector(self, head_dim: int) -> float:
        """Bytes of one token's key (or value) vector of D elements in one head: `D · bits / 8`
        codes plus its share of scales and zero points (`scales_per_vector` each, in
        `scale_dtype`). Multiply by 2 · L · H_kv (keys and values) for a token's bytes."""
        overhead = self.scale_dtype.itemsize * (1 if self.symmetric else 2)
        return head_dim * self.bits / 8 + self.scales_per_vector(head_dim) * overhead


@dataclasses.dataclass
class QuantizedTensor:
    """A quantized `(..., S, D)` tensor.

    codes: int8 (8-bit symmetric), uint8 (8-bit asymmetric; 4- and 2-bit packed along the last
        axis, `D · bits / 8` bytes per vector) or the fp8 dtype.
    scale: `scale_dtype`, the shape of the input with the reduced axis cut to its number of
        groups (`(..., S, D / g)` per token, `(..., S / G, D)` per channel, all ones per tensor).
    zero: like `scale` (asymmetric), else None.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    scheme: QuantScheme
    shape: tuple[int, ...]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, scales and zero points."""
        parts = [self.codes, self.scale] + ([] if self.zero is None else [self.zero])
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def num_tokens(self) -> int:
        return self.shape[-2]


def _check_tensor(x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
        raise ValueError(
            "x: expected a floating-point (..., S, D) tensor, got "
            f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}"
        )
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz):
        raise ValueError(f"x: expected a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    return x


def _grouped(x: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, tuple[int, ...]]:
    """x viewed so that each scale's elements share one axis: returns (view, the reduced dims)."""
    if scheme.reduce == "all":
        return x, tuple(range(x.dim()))
    axis = x.dim() + REDUCE_AXES[scheme.reduce]
    length = x.shape[axis]
    group = scheme.group_size or length
    if length % group:
        raise ValueError(
            f"group_size: {scheme.group_size} must divide the reduced axis "
            f"({scheme.reduce}, {length} long) of x {tuple(x.shape)}"
        )
    shape = (*x.shape[:axis], length // group, group, *x.shape[axis + 1 :])
    return x.reshape(shape), (axis + 1,)


def _round_to(t: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """t (float64) rounded to `dtype` toward +inf (`up`) or -inf, so that the stored value bounds
    the true one from that side."""
    r = t.to(dtype)
    bad = (r.double() < t) if up else (r.double() > t)
    if bad.any():
        inf = torch.full_like(r, math.inf if up else -math.inf)
        r = torch.where(bad, torch.nextafter(r, inf), r)
    return r


def quantize(x: torch.Tensor, scheme: QuantScheme) -> QuantizedTensor:
    """Quantize `x` `(..., S, D)` under `scheme` (see the module docstring for the formulas).

    Returns:
        a `QuantizedTensor`; `dequantize` inverts it within `round_trip_bound`.
    Raises:
        ValueError: x not a floating (..., S, D) tensor or not finite; a group size that does not
        divide the reduced axis; int4/int2 with D not a multiple of 2 or 4 (packing); a scale too
        large for `scheme.scale_dtype`.
    """
    x = _check_tensor(x)
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"scheme: expected a QuantScheme, got {type(scheme).__name__}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x: expected finite values (found inf or NaN)")
    fmt = scheme.fmt
    per_byte = 8 // fmt.bits
    if x.shape[-1] % per_byte:
        raise ValueError(
            f"x: {fmt.name} packs {per_byte} codes per byte along D; D = {x.shape[-1]} is not a "
            f"multiple of {per_byte}"
        )
    xf = x.double()  # scales and codes from exact arithmetic: the stored scale bounds the range
    grouped, dims = _grouped(xf, scheme)
    if scheme.symmetric:
        qmax = fmt.max if fmt.is_float else 2 ** (fmt.bits - 1) - 1
        absmax = grouped.abs().amax(dim=dims, keepdim=True)
        zero = None
        scale = _round_to(absmax / qmax, scheme.scale_dtype, up=True)
    else:
        qmax = 2**fmt.bits - 1
        zero = _round_to(grouped.amin(dim=dims, keepdim=True), scheme.scale_dtype, up=False)
        span = grouped.amax(dim=dims, keepdim=True) - zero.double()
        scale = _round_to(span / qmax, scheme.scale_dtype, up=True)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(
            f"x: a scale overflows scale_dtype {scheme.scale_dtype} (|x| up to "
            f"{float(xf.abs().max()):.3g}); use scale_dtype=torch.float32"
        )
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero range: codes 0
    shifted = grouped if zero is None else grouped - zero.double()
    scaled = (shifted / scale.double()).reshape(x.shape)
    if fmt.is_float:
        codes = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    else:
        low = -qmax if scheme.symmetric else 0
        levels = scaled.round().clamp(low, qmax).to(torch.int16)
        if fmt.bits == 8:
            codes = levels.to(torch.int8 if scheme.symmetric else torch.uint8)
        else:
            codes = pack_bits(levels + (2 ** (fmt.bits - 1) if scheme.symmetric else 0), fmt.bits)
    squeeze = _squeeze_shape(x.shape, scheme)
    return QuantizedTensor(
        codes,
        scale.reshape(squeeze),
        None if zero is None else zero.reshape(squeeze),
        scheme,
        tuple(x.shape),
    )


def _squeeze_shape(shape, scheme: QuantScheme) -> tuple[int, ...]:
    """Shape of the scales: the input's, the reduced axis cut to its number of groups."""
    if scheme.reduce == "all":
        return (1,) * len(shape)
    axis = len(shape) + REDUCE_AXES[scheme.reduce]
    groups = shape[axis] // (scheme.group_size or shape[axis])
    return (*shape[:axis], groups, *shape[axis + 1 :])


def _expand(t: torch.Tensor, shape, scheme: QuantScheme) -> torch.Tensor:
    """Scales or zero points broadcast back to every element."""
    if scheme.reduce == "all":
        return t
    axis = len(shape) + REDUCE_AXES[scheme.reduce]
    return t.repeat_interleave(shape[axis] // t.shape[axis], dim=axis)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`x̂` `q.shape` in `dtype`: `s · code (+ z)`, computed in float32."""
    fmt, scheme = q.scheme.fmt, q.scheme
    if fmt.is_float or fmt.bits == 8:
        values = q.codes.float()
    else:
        values = unpack_bits(q.codes, fmt.bits).float()
        if scheme.symmetric:
            values = values - 2 ** (fmt.bits - 1)
    out = values * _expand(q.scale, q.shape, scheme).float()
    if q.zero is not None:
        out = out + _expand(q.zero, q.shape, scheme).float()
    return out.to(dtype)


def round_trip_bound(q: QuantizedTensor, x: torch.Tensor) -> torch.Tensor:
    """The largest `|x - x̂|` each element may have (same shape as x, float64): half a step `s/2`
    for integers; half an fp8 ulp of `x / s` times s for fp8 (see the module docstring); plus the
    float32 rounding of computing `x̂` (4 ulps of |x| + |z|)."""
    fmt = q.scheme.fmt
    scale = _expand(q.scale, q.shape, q.scheme).double()
    xd = x.double()
    if fmt.is_float:
        half_ulp = (xd.abs() / scale * 2.0 ** -(fmt.mantissa_bits + 1)).clamp(
            min=2.0 ** (fmt.min_normal_exp - fmt.mantissa_bits - 1)
        )
        bound = scale * half_ulp
    else:
        bound = scale / 2
    magnitude = xd.abs() + (0 if q.zero is None else _expand(q.zero, q.shape, q.scheme).abs())
    return bound + magnitude * 4 * torch.finfo(torch.float32).eps


def pack_bits(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned `bits`-bit levels (any int dtype, values in [0, 2^bits)) along the last axis,
    `8 // bits` per uint8, the first element in the lowest bits (KIVI's and GGUF's order).

    Raises:
        ValueError: bits not 2 or 4, a last axis not a multiple of 8 // bits, or a level out of
        range.
    """
    if bits not in (2, 4):
        raise ValueError(f"bits: expected 2 or 4, got {bits!r}")
    per_byte = 8 // bits
    if levels.shape[-1] % per_byte:
        raise ValueError(
            f"levels: last axis {levels.shape[-1]} is not a multiple of {per_byte} ({bits}-bit)"
        )
    if levels.numel() and (int(levels.min()) < 0 or int(levels.max()) >= 2**bits):
        raise ValueError(f"levels: expected values in [0, {2**bits}), got a value out of range")
    grouped = levels.to(torch.int32).reshape(*levels.shape[:-1], -1, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=levels.device) * bits
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 (..., n) -> int16 levels (..., n · 8 / bits)."""
    if bits not in (2, 4):
        raise ValueError(f"bits: expected 2 or 4, got {bits!r}")
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int16, device=packed.device) * bits
    levels = (packed.to(torch.int16)[..., None] >> shifts) & (2**bits - 1)
    return levels.flatten(-2)


def cat_quantized(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Concatenate quantized tensors of one scheme along the token axis (S). Per-channel schemes
    keep their groups: each part's S must be a whole number of groups (it was, to be quantized).

    Raises:
        ValueError: no parts, parts of different schemes or shapes, or a per-tensor scheme (one
        scale per part cannot be merged).
    """
    if not parts:
        raise ValueError("parts: expected at least one QuantizedTensor")
    scheme = parts[0].scheme
    if scheme.reduce == "all":
        raise ValueError("parts: per-tensor quantized tensors have one scale each; cannot merge")
    if any(
        p.scheme != scheme
        or p.shape[:-2] + p.shape[-1:] != parts[0].shape[:-2] + parts[0].shape[-1:]
        for p in parts
    ):
        raise ValueError("parts: expected one scheme and equal shapes except S")
    if len(parts) == 1:
        return parts[0]
    shape = (*parts[0].shape[:-2], sum(p.shape[-2] for p in parts), parts[0].shape[-1])
    zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts], dim=-2)
    return QuantizedTensor(
        torch.cat([p.codes for p in parts], dim=-2),
        torch.cat([p.scale for p in parts], dim=-2),
        zero,
        scheme,
        shape,
    )
