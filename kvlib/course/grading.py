"""Graded questions: the registry, what a test sees of the learner's code, and how one question is
run.

A chapter's questions are test functions in `kvlib/course/checks/chNN.py`, one per question, each
declared with `@question(...)` (points, the function the learner writes, the kvlib functions it
replaces, see `kvlib.course.blocked`). The learner's code never runs in the process that holds a
test: a test receives a `Submission` whose functions are `Remote`s; calling one sends the inputs
to the learner's process by value and returns the outputs by value (`kvlib.course.wire`).
`run_question` runs a test against either learner's side:

- the grader (`python -m kvlib.course.grade NOTEBOOK`, `kvlib.course.grader`): a fresh child
  process (`kvlib.course.sandbox`) that executed the notebook's code cells;
- `check("question_id", function)` in the notebook (`kvlib.course.checking`): a grader subprocess
  runs the same test with the same protocol against the notebook's process, so the two verdicts
  cannot differ.

Random cases are drawn per run from `Submission.rng()` / `torch_generator()`, seeded from the
learner's function's source (check() and the grader draw the same cases; the seed is in the
failure message). What the learner's process measures (the torch operators a call ran, its peak
allocations, the reads a RowReadCounter counted, whether a result aliases an input) is measured
there, by code that the learner's code could patch; what it cannot reach is the test, the
expected values and the verdict. Nor does the grader sandbox the machine (learner code runs with
the learner's permissions, on the learner's machine) or grade prose.

`check`, `show`, `grade_notebook` and the rest of the grader's API stay importable from here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from kvlib.course.blocked import (  # noqa: F401 (the checks import them from here)
    ATTENTION_API,
    BREAK_EVEN_API,
    COMPACTION_API,
    EVICTION_API,
    MEMORY_API,
    OFFLOAD_KEYS_API,
    OFFLOAD_TIERS_API,
    PAGING_API,
    QUANT_API,
    ROPE_API,
    SCHEDULER_API,
)
from kvlib.course.guards import GradingError  # noqa: F401 (raised in the learner's process)

ENV_GRADING = "KVLIB_GRADING"  # "1" while a notebook is executed by the grader: check() is silent
MESSAGE_CHARS = 400  # longest message kept per question


@dataclasses.dataclass(frozen=True)
class Question:
    """One graded question: its test, the learner function it grades and what it blocks."""

    id: str
    function: str
    points: int
    blocked: tuple[str, ...]
    test: Callable[[Submission], None]
    chapter: str


_QUESTIONS: dict[str, Question] = {}


def question(*, function: str, points: int = 1, blocked: tuple[str, ...] = ()) -> Callable:
    """Declare a pytest test `test_<id>(submission)` as a graded question.

    Args:
        function: the name the learner defines in the notebook.
        points: what passing is worth.
        blocked: dotted names of kvlib functions that are unavailable while it is graded
            (the functions the learner is asked to write).
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
            question_id, function, points, tuple(blocked), test, chapter
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
        available = sorted(
            p.stem.removeprefix("ch")
            for p in Path(__file__).with_name("checks").glob("ch[0-9]*.py")
        )
        raise ValueError(
            f"chapter: no graded questions for chapter {chapter!r}; chapters with exercises: "
            f"{available}"
        ) from None
    return [q for q in _QUESTIONS.values() if q.chapter == f"ch{chapter}"]


def chapter_of(notebook: str | os.PathLike) -> str:
    """The chapter number of an exercise notebook from its file name: `01_naive_vs_cached.ipynb` ->
    "01"."""
    match = re.match(r"(\d\d)_", Path(notebook).name)
    if not match:
        raise ValueError(
            f"notebook: expected a file named NN_<chapter>.ipynb, got {Path(notebook).name!r}"
        )
    return match.group(1)


class LearnerRaised(Exception):
    """The learner's function raised (in the learner's process): its type and message."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"your code raised {type_name}: {message}")
        self.type_name = type_name


class QuestionTimeout(Exception):
    """The learner's process ran past the question's time; the grader killed it."""


class ProcessEnded(Exception):
    """The learner's process ended while a call ran (os._exit, a crash, a kill)."""


@dataclasses.dataclass
class Call:
    """One call of the learner's function, seen from the grader: what it returned, its arguments
    after the call (to see mutation), and what the learner's side measured."""

    result: object
    args: list
    aliases: list[int]  # indices of the arguments the result is or shares memory with
    info: dict


class Remote:
    """The learner's function, in the learner's process: calling it sends the inputs there and
    returns the outputs by value."""

    def __init__(self, submission: Submission, name: str, description: dict):
        self._submission, self.name, self.description = submission, name, description

    @property
    def is_triton_kernel(self) -> bool:
        return bool(self.description.get("jit"))

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs).result

    def call(self, *args, _options: dict | None = None, **kwargs) -> Call:
        """Call with `args`, `kwargs`; `_options`: measure_memory, torch_ops, grid, and
        `mutates` (indices of the arguments the function is meant to change in place; any other
        argument it changes fails the question) and `may_alias` (the result may be, or be a
        view of, an argument; otherwise that fails the question too)."""
        options = {"blocked": self._submission.question.blocked, **(_options or {})}
        reply = self._submission._request(("call", self.name, list(args), kwargs, options))
        from kvlib.course.wire import decode

        if reply[0] == "raised":
            if reply[1] == "GradingError" or reply[2].startswith("expected a @triton.jit"):
                raise AssertionError(reply[2])
            raise LearnerRaised(reply[1], reply[2])
        try:
            info = decode(reply[3])
            refs: list = []
            result = decode(reply[1], refs)
            args_after = decode(reply[2], refs) if reply[2] is not None else list(args)
        except (ValueError, TypeError, RecursionError) as exc:
            raise AssertionError(
                f"`{self.name}` returned a value the grader cannot read: {exc}"
            ) from None
        call = Call(result, args_after, list(info.get("aliases", [])), info)
        options = _options or {}
        mutates = set(options.get("mutates", ()))
        # reported once the test's own checks pass: their hints come first
        for index, (before, after) in enumerate(zip(args, call.args)):
            if index not in mutates and not _same_value(before, after):
                self._submission.violations.append(
                    f"`{self.name}` changed its argument {index + 1} ({_kind(before)}) in place: "
                    "leave its inputs as they were"
                )
        if call.aliases and not options.get("may_alias") and not options.get("grid"):
            index = call.aliases[0]
            self._submission.violations.append(
                f"`{self.name}` returned its argument {index + 1} ({_kind(args[index])}) itself "
                "or a view of it: return a new object"
            )
        return call

    def launch(self, grid: tuple, *args, _mutates=(), **kwargs) -> Call:
        """Launch a Triton kernel `kernel[grid](*args, **kwargs)` in the learner's process, under
        Triton's interpreter (CPU tensors)."""
        if not self.is_triton_kernel:
            raise AssertionError(
                f"`{self.name}` should be a @triton.jit kernel (a triton JITFunction), got a "
                f"{self.description.get('type', '?')}"
            )
        call = self.call(*args, _options={"grid": tuple(grid), "mutates": _mutates}, **kwargs)
        if not call.info.get("interpreter"):
            raise AssertionError(
                "the kernel did not run under Triton's interpreter: the grader launches it on CPU "
                "tensors, which need TRITON_INTERPRET=1 set before @triton.jit runs (import "
                "kvlib.kernels first), on a GPU machine too"
            )
        return call


def expect_list(got, item_ok: Callable[[object], bool], should: str) -> None:
    """Fail unless `got` is a list whose every item passes `item_ok`, with the message `should`
    (what the learner's function should return) followed by what it returned."""
    assert isinstance(got, list) and all(item_ok(item) for item in got), f"{should}, got {got!r}"


def expect_tensor(got, expected, name: str) -> None:
    """Fail unless `got` is a torch.Tensor of `expected`'s shape and dtype (values are the
    caller's to compare)."""
    import torch

    assert isinstance(got, torch.Tensor), (
        f"{name}: expected a torch.Tensor, got {type(got).__name__}"
    )
    assert tuple(got.shape) == tuple(expected.shape), (
        f"{name}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    )
    assert got.dtype == expected.dtype, (
        f"{name}: expected dtype {expected.dtype} (the inputs' own), got {got.dtype}"
    )


def peak_allocation(info: dict) -> tuple[int, str]:
    """The peak bytes a learner's call allocated (`_options={"measure_memory": True}`): PyTorch's
    CPU allocator plus numpy/Python's (tracemalloc), and a phrase for a hint naming both, in MiB."""
    torch_bytes, python_bytes = info["torch_peak_bytes"], info["python_peak_bytes"]
    peak = torch_bytes + python_bytes
    return peak, (
        f"{peak / 2**20:.1f} MiB (PyTorch's CPU allocator {torch_bytes / 2**20:.1f} MiB + "
        f"numpy/Python {python_bytes / 2**20:.1f} MiB, traced)"
    )


def _kind(value) -> str:
    shape = getattr(value, "shape", None)
    return type(value).__name__ + (f" of shape {tuple(shape)}" if shape is not None else "")


def _same_value(a, b) -> bool:
    """Whether `b` (an argument after the call, rebuilt here) still equals `a` (as sent)."""
    import numpy as np
    import torch

    from kvlib.course.wire import Opaque

    if isinstance(b, Opaque) or not isinstance(a, (list, tuple, dict, set, frozenset, int, float,
                                                  str, bytes, bool, type(None), np.ndarray,
                                                  np.generic, torch.Tensor)):  # fmt: skip
        return True  # an object of another type: its state is the test's to judge
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        a = a.detach().cpu()
        if a.is_floating_point():  # NaN where it was NaN is unchanged
            nan = a.isnan()
            return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and list(a) == list(b) and all(_same_value(a[k], b[k]) for k in a)
        )
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and a == b


class Submission:
    """The learner's definitions, as the tests see them: `function(name)` is a `Remote`."""

    def __init__(self, side, question: Question, errors: list[str] | None = None):
        self._side, self.question = side, question
        self.errors = errors or []
        self.seed: int | None = None
        self.seed_used = False
        self.violations: list[str] = []  # inputs changed or returned, found by Remote.call

    def _request(self, message):
        return self._side.request(message)

    def function(self, name: str) -> Remote:
        """The learner's function `name`; fails the question with a clear message if missing."""
        _, description = self._request(("describe", name))
        if description["kind"] == "missing":
            hint = f" The notebook raised while it ran: {self.errors[0]}" if self.errors else ""
            raise AssertionError(
                f"`{name}` is not defined: keep its cell and its name as given.{hint}"
            )
        if description["kind"] != "callable":
            raise AssertionError(
                f"`{name}` should be a function, but it is a {description.get('type')}"
            )
        if self.seed is None:
            digest = description.get("source_sha") or hashlib.sha256(name.encode()).hexdigest()
            self.seed = int(digest[:8], 16)
        return Remote(self, name, description)

    def rng(self, stream: int = 0):
        """A numpy Generator for this run's random cases: seeded from the learner's function's
        source (so check() and the grader draw the same cases), reported in a failure message."""
        import numpy as np

        self.seed_used = True
        return np.random.default_rng([self.seed or 0, stream])

    def torch_generator(self, stream: int = 0):
        import torch

        self.seed_used = True
        return torch.Generator().manual_seed(((self.seed or 0) * 1_000_003 + stream) % 2**63)


def run_question(q: Question, side, errors: list[str]) -> tuple[bool, str]:
    """Run `q`'s test against the learner's side `side`: (passed, message). The same function for
    check() and the grader, so their verdicts cannot differ."""
    side.request(("guard", list(q.blocked), q.id))
    submission = Submission(side, q, errors)
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
    except QuestionTimeout as exc:
        return False, str(exc)
    except ProcessEnded as exc:
        return False, str(exc)
    except Exception as exc:  # noqa: BLE001 - the test failed on an answer of an unexpected shape
        message = f"your answer could not be checked ({type(exc).__name__}: {exc})"
    else:
        return True, ""
    message = _shorten(message)
    if submission.seed_used and "seed" not in message:
        message = _shorten(message, MESSAGE_CHARS - 40) + f" [random cases: seed {submission.seed}]"
    return False, message


def _shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ELSEWHERE = {
    "kvlib.course.checking": ("check", "show"),
    "kvlib.course.grader": ("grade_notebook", "read_code_cells", "GradeReport", "QuestionResult",
                            "main"),
}  # fmt: skip


def __getattr__(name: str):
    """`check`, `show` and the grader's API, importable from here as before (imported lazily: those
    modules import this one)."""
    for module, names in _ELSEWHERE.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
