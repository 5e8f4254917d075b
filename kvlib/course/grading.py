"""Graded questions (test functions in `kvlib/course/checks/chNN.py`): the registry
(`question`), what a test sees of the learner's code (`Submission`: `function(name)` is a `Remote`,
whose calls run in the learner's process) and how one question is run (`run_question`: the same for
the grader and `check()`, so that their verdicts cannot differ). `check`, `show` and the grader's
API stay importable from here.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvlib.course.guards import GradingError  # noqa: F401 (raised in the learner's process)
from kvlib.course.remote import (  # noqa: F401 (the checks import them from here)
    Call,
    LearnerRaised,
    ProcessEnded,
    QuestionTimeout,
    Remote,
    expect_int,
    expect_list,
    expect_tensor,
    is_int,
    peak_allocation,
)
from kvlib.course.wire import ParentRows

ENV_GRADING = "KVLIB_GRADING"  # "1" while a notebook is executed by the grader: check() is silent
MESSAGE_CHARS = 600  # longest message kept per question (a check's own, 400, and a mistake's name)


@dataclasses.dataclass(frozen=True)
class Question:
    """One graded question (`question` says what each field holds)."""

    id: str
    function: str
    points: int
    allowed: tuple[str, ...]
    test: Callable[[Submission], None]
    chapter: str
    torch_ops: bool = False


_QUESTIONS: dict[str, Question] = {}


def question(*, function: str, points: int = 1, allowed: tuple[str, ...] = (),
             torch_ops: bool = False) -> Callable:  # fmt: skip
    """Declare a pytest test `test_<id>(submission)` as a graded question.

    Args:
        function: the name the learner defines in the notebook.
        points: what passing is worth.
        allowed: dotted names of the kvlib functions (or classes) the answer may call while it
            is graded, where they are defined (`kvlib.cache.block_pool.hash_block_tokens`);
            every other kvlib function is unavailable.
        torch_ops: the test asks which torch operators a call ran (`_options={"torch_ops":
            True}`): torch's profiler, started once before the notebook loads (the memory it
            keeps is the grader's, not the notebook's).
    """

    def register(test: Callable[[Submission], None]) -> Callable[[Submission], None]:
        if not test.__name__.startswith("test_"):
            raise ValueError(
                f"test: expected a function named test_<question id>, got {test.__name__}"
            )
        question_id = test.__name__.removeprefix("test_")
        chapter = test.__module__.rsplit(".", 1)[-1]
        if question_id in _QUESTIONS and _QUESTIONS[question_id].chapter != chapter:
            raise ValueError(
                f"question id {question_id!r} is used by chapters "
                f"{_QUESTIONS[question_id].chapter} and {chapter}"
            )
        _QUESTIONS[question_id] = Question(
            question_id, function, points, tuple(allowed), test, chapter, torch_ops
        )
        return test

    return register


def chapter_questions(chapter: str) -> list[Question]:
    """The questions of chapter `chapter` ("01", "02", ...) in the order they are defined.

    Raises:
        ValueError: kvlib has no checks for that chapter.
    """
    try:
        importlib.import_module(f"kvlib.course.checks.ch{chapter}")
    except ModuleNotFoundError as exc:
        if exc.name != f"kvlib.course.checks.ch{chapter}":
            raise
        checks = Path(__file__).with_name("checks").glob("ch[0-9]*.py")
        available = sorted(p.stem.removeprefix("ch") for p in checks)
        raise ValueError(
            f"chapter: no graded questions for chapter {chapter!r}; chapters with exercises: "
            f"{available}"
        ) from None
    return [q for q in _QUESTIONS.values() if q.chapter == f"ch{chapter}"]


def chapter_of(notebook: str | os.PathLike) -> str:
    """The chapter number of an exercise notebook from its file name: `01_naive_vs_cached.ipynb` ->
    "01"."""
    name = Path(notebook).name
    match = re.match(r"(\d\d)_", name)
    if not match:
        raise ValueError(f"notebook: expected a file named NN_<chapter>.ipynb, got {name!r}")
    return match.group(1)


class Submission:
    """The learner's definitions, as the tests see them: `function(name)` is a `Remote`, which
    sends its calls through `side` (the learner's side: `request(message)` -> its reply).

    Random cases come from `rng()` / `torch_generator()`, seeded by the run's `seed` and the
    question. `draws_only`: skip the fixed cases and checks (`fixed()`, `fixed_cases`), for the
    tests that run a question's random cases many times."""

    def __init__(self, side, question: Question, errors: list[str] | None = None, *,
                 seed: int = 0, binding: str = "", draws_only: bool = False):  # fmt: skip
        self.side, self.question, self.errors = side, question, errors or []
        self.seed, self.binding, self.fixed_cases = int(seed), binding, not draws_only
        self.seed_used = False
        self.violations: list[str] = []  # inputs changed or returned, found by Remote.call
        self.notes: list[str] = []  # said whether the question passes or not
        self.flags: list[str] = []  # how the answer computed, by its process's word: not scored

    def flag(self, text: str) -> None:
        """Say how the answer computed, by its process's word (which learner code can rewrite):
        beside the verdict, never part of it (book/grader_guarantees.md)."""
        if text not in self.flags:
            self.flags.append(text)

    def fixed(self, cases) -> list:
        """`cases`, or none when only the random cases are run."""
        return list(cases) if self.fixed_cases else []

    def function(self, name: str) -> Remote:
        """The learner's function `name`; fails the question with a clear message if missing."""
        target = self.binding if self.binding and name == self.question.function else name
        own = self.question.id if target == name else ""  # check() saw the question's own
        _, description = self.side.request(("describe", target, own))
        if description["kind"] == "missing":
            hint = f" The notebook raised while it ran: {self.errors[0]}" if self.errors else ""
            raise AssertionError(
                f"`{name}` is not defined: keep its cell and its name as given.{hint}"
            )
        if description["kind"] != "callable":
            raise AssertionError(
                f"`{name}` should be a function, but it is a {description.get('type')}"
            )
        if description.get("checked") is False:
            cell = description.get("defined_in")
            self.notes.append(
                f"note: the `{name}` graded here is not the one your check() cell checked: "
                f"{'cell ' + str(cell) if cell is not None else 'a later cell'} defines it again"
            )
        return Remote(self, name, description, target)

    def _key(self, stream: int) -> list[int]:
        self.seed_used = True
        return [self.seed, zlib.crc32(self.question.id.encode()), stream]

    def rng(self, stream: int = 0):
        """A numpy Generator for this run's random cases (the seed is in a failure message)."""
        return np.random.default_rng(self._key(stream))

    def torch_generator(self, stream: int = 0):
        import torch

        seed = int(np.random.SeedSequence(self._key(stream)).generate_state(1, np.uint64)[0])
        return torch.Generator().manual_seed(seed % 2**63)

    def rows(self, array, max_rows: int) -> ParentRows:
        """`array` (S, D) as an argument that stays here: the learner's code reads it `max_rows`
        rows at a time, each read counted (`.reads`, per row, after the call)."""
        return ParentRows(array, max_rows)


def run_question(
    q: Question, side, errors: list[str], seed: int = 0, *, binding: str = "",
    draws_only: bool = False,
) -> tuple[bool, str]:  # fmt: skip
    """Run `q`'s test against the learner's side `side`: (passed, message). The same function for
    check() and the grader, so their verdicts cannot differ. `seed`: the run's random cases;
    `binding`: the name of the function to grade, when not the question's own."""
    side.request(("guard", list(q.allowed), q.id))
    submission = Submission(side, q, errors, seed=seed, binding=binding, draws_only=draws_only)
    try:
        q.test(submission)
        if submission.violations:
            raise AssertionError(submission.violations[0])
    except AssertionError as exc:
        message = str(exc) or "the check failed"
    except LearnerRaised as exc:
        if exc.type_name == "NotImplementedError":  # not written yet: no case to reproduce
            return False, _shorten(str(exc))
        message = str(exc)
    except (QuestionTimeout, ProcessEnded) as exc:
        return False, _with_notes(str(exc), submission)
    except Exception as exc:  # noqa: BLE001 - the test failed on an answer of an unexpected shape
        message = f"your answer could not be checked ({type(exc).__name__}: {exc})"
    else:
        return True, _with_notes("", submission)
    message = _shorten(message)
    if submission.seed_used and "seed" not in message:
        message = _shorten(message, MESSAGE_CHARS - 40) + f" [random cases: seed {seed}]"
    return False, _with_notes(message, submission)


def _with_notes(message: str, submission: Submission) -> str:
    flags = [f"flag (reported by your process, not scored): {f}" for f in submission.flags]
    return _shorten(" ".join([message, *submission.notes, *flags]).strip(), 2 * MESSAGE_CHARS)


def _shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def __getattr__(name: str):
    """`check`, `show` and the grader's API, importable from here as before (imported lazily: those
    modules import this one)."""
    if name in ("check", "show"):
        return getattr(importlib.import_module("kvlib.course.checking"), name)
    if name in ("grade_notebook", "read_code_cells", "GradeReport", "QuestionResult", "main"):
        return getattr(importlib.import_module("kvlib.course.grader"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
