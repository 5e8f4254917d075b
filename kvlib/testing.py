"""Comparison helpers shared by kvlib's tests and the exercise checks.

`assert_close` states its tolerances and reports the largest difference and where it is (the
nanochat / `torch.testing.assert_close` idiom), so a failure says how wrong, not just "wrong".
"""

from __future__ import annotations

import numpy as np


def assert_close(
    actual, expected, *, name: str = "result", rtol: float = 1e-9, atol: float = 1e-12
) -> None:
    """Assert |actual - expected| <= atol + rtol * |expected| elementwise (numpy arrays or torch
    tensors).

    Raises:
        AssertionError: wrong type, shape, non-finite values where expected is finite, or a
            difference beyond tolerance; the message gives the max absolute difference and its
            index.
    """
    actual, expected = _to_numpy(actual, f"{name}"), _to_numpy(expected, f"expected {name}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: expected shape {expected.shape}, got {actual.shape}")
    actual, expected = actual.astype(np.float64), expected.astype(np.float64)
    bad_finite = np.isfinite(expected) & ~np.isfinite(actual)
    if bad_finite.any():
        index = tuple(int(i) for i in np.argwhere(bad_finite)[0])
        raise AssertionError(
            f"{name}: got {actual[index]} at index {index} where {expected[index]:.6g} was expected"
        )
    diff = np.abs(actual - expected)
    allowed = atol + rtol * np.abs(expected)
    if np.any(diff > allowed):
        index = np.unravel_index(int(np.argmax(diff - allowed)), diff.shape)
        raise AssertionError(
            f"{name}: max abs difference {diff.max():.3g} (at index "
            f"{tuple(int(i) for i in index)}: got "
            f"{actual[index]:.6g}, expected {expected[index]:.6g}); tolerance atol={atol:g}, "
            f"rtol={rtol:g}"
        )


def _to_numpy(value, name: str) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = (
            value.detach().cpu().float().numpy()
            if str(value.dtype) == "torch.bfloat16"
            else value.detach().cpu().numpy()
        )
    if not isinstance(value, (np.ndarray, np.generic, int, float)):
        raise AssertionError(f"{name}: expected an array, got {type(value).__name__}")
    return np.asarray(value)
