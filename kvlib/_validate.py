"""Argument validation shared by kvlib's public functions.

Every check raises `TypeError` (wrong kind of object or dtype) or `ValueError` (wrong shape or
value) with a message that names the argument, what was expected and what was given. Nothing is
broadcast, truncated or cast silently.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_array(
    name: str,
    value: object,
    *,
    ndim: int | Sequence[int] | None = None,
    floating: bool = False,
    integer: bool = False,
) -> np.ndarray:
    """Check that `value` is a numpy array with the given rank and dtype kind; return it.

    Raises:
        TypeError: `value` is not a numpy array, or its dtype is not floating/integer as asked.
        ValueError: its number of dimensions is not `ndim` (or not one of `ndim`).
    """
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.ndim not in allowed:
            expected = " or ".join(str(n) for n in allowed)
            raise ValueError(
                f"{name}: expected {expected} dimensions, got shape {value.shape} ({value.ndim} "
                "dimensions)"
            )
    if floating and not np.issubdtype(value.dtype, np.floating):
        raise TypeError(f"{name}: expected a floating-point dtype, got {value.dtype}")
    if integer and not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {value.dtype}")
    return value


def check_positive_int(name: str, value: object, *, allow_zero: bool = False) -> int:
    """Check that `value` is an int (not a bool) greater than 0 (or >= 0); return it.

    Raises:
        TypeError: `value` is not an int.
        ValueError: `value` is negative, or zero when `allow_zero` is false.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    low = 0 if allow_zero else 1
    if value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value}")
    return int(value)


def check_shape(x: object, expected: Sequence[int | None], name: str = "x") -> None:
    """Assert that `x.shape == expected` (`None` in `expected` matches any size).

    The notebooks' inline shape check (the d2l idiom): `check_shape(k_cache, (S, D))`.

    Raises:
        ValueError: the shapes differ, naming both.
    """
    shape = tuple(getattr(x, "shape", ()))
    expected = tuple(expected)
    if len(shape) != len(expected) or any(
        e is not None and s != e for s, e in zip(shape, expected)
    ):
        raise ValueError(f"{name}: expected shape {expected}, got {shape}")


def same_device(a, b) -> bool:
    """Whether two devices (`torch.device` or str) name the same device: "cuda" (no index) is the
    current CUDA device, so it equals "cuda:0" when device 0 is current."""
    import torch

    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)
