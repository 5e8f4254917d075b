"""Naming a learner's mistake: when an answer fails a check, compare it with the answers that the
common mistakes of that question give, and say which one it equals.

Each check keeps a small table, `{what the mistake is: a function computing the answer it
gives}`, built from the question's own inputs. The mistaken answers are computed here, in the
grader's process, and only once a check has failed, so a passing answer costs nothing and a
verdict never depends on a diagnostic: `naming_mistakes` only adds words to a failure's message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np

Mistakes = Mapping[str, Callable[[], object]]  # the mistake, in words -> the answer it gives
_NO_ANSWER = object()


def matching_mistake(got, mistakes: Mistakes, *, rtol: float = 1e-6, atol: float = 1e-9,
                     expected=_NO_ANSWER):  # fmt: skip
    """The description of the first mistake in `mistakes` whose answer equals `got`, or None.

    Arrays and tensors match when they have the same shape and agree within `rtol`/`atol`;
    ints, lists and tuples match when equal (a numpy integer equals the same int), dicts when
    their keys and values do. A mistake whose answer cannot be computed for these inputs is
    skipped, and so is one whose answer equals `expected` (the right answer, where given): on
    these inputs it is no mistake.
    """
    for description, answer in mistakes.items():
        try:
            with np.errstate(all="ignore"):
                value = answer()
        except Exception:  # noqa: BLE001 - a mistake that does not apply to these inputs
            continue
        if expected is not _NO_ANSWER and _equal(expected, value, rtol, atol):
            continue
        if _equal(got, value, rtol, atol):
            return description
    return None


@contextlib.contextmanager
def naming_mistakes(got, mistakes: Mistakes, **options) -> Iterator[None]:
    """Run a check's assertions on `got`; when one fails, and `got` equals the answer of one of
    `mistakes`, the failure's message starts with that mistake, in words. `options`:
    `matching_mistake`'s tolerance and `expected`.

    Raises:
        AssertionError: the check's own, its message extended (never a new failure).
    """
    try:
        yield
    except AssertionError as exc:
        description = matching_mistake(got, mistakes, **options)
        if description is None:
            raise
        message = f"your answer matches a common mistake: {description}. {exc}"
        raise AssertionError(message) from None


def _equal(got, value, rtol: float, atol: float) -> bool:
    if isinstance(value, Mapping):
        return (
            isinstance(got, Mapping)
            and got.keys() == value.keys()
            and all(_equal(got[k], v, rtol, atol) for k, v in value.items())
        )
    if isinstance(value, (tuple, list)):
        return (
            isinstance(got, (tuple, list))
            and len(got) == len(value)
            and all(_equal(g, v, rtol, atol) for g, v in zip(got, value))
        )
    if isinstance(value, (bool, np.bool_, str, bytes)) or value is None:
        return type(got) is type(value) and got == value
    if isinstance(value, (int, np.integer)) and isinstance(got, (int, np.integer)):
        return not isinstance(got, (bool, np.bool_)) and int(got) == int(value)
    try:
        got_array, value_array = _as_array(got), _as_array(value)
    except (TypeError, ValueError):
        return False
    if got_array.shape != value_array.shape or got_array.dtype.kind not in "biuf":
        return False
    return bool(
        np.allclose(got_array.astype(np.float64), value_array.astype(np.float64), rtol=rtol,
                    atol=atol, equal_nan=True)
    )  # fmt: skip


def _as_array(value) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu().double().numpy()
    if isinstance(value, (np.ndarray, np.generic, int, float)) and not isinstance(value, bool):
        return np.asarray(value)
    raise TypeError(f"not a number or an array: {type(value).__name__}")
