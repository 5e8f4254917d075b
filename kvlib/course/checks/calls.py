"""Calling a learner's function from a check: the answer for one case, or a failure that names the
case (chapters 16 and 17)."""

from __future__ import annotations

from kvlib.course.grading import LearnerRaised


def answer_of(function, args: tuple, what: str):
    """The learner's answer for `args` (`function` a `Remote`; the result may alias an argument);
    an exception it raises fails the question naming the case, `what` (a function not written
    yet keeps the grader's own message)."""
    try:
        return function.call(*args, _options={"may_alias": True}).result
    except LearnerRaised as error:
        if error.type_name == "NotImplementedError":
            raise
        raise AssertionError(f"{what}: {error}") from None
