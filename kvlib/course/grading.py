"""Exercise checks and the grader.

A chapter's questions are pytest tests in `kvlib/course/checks/chNN.py`, one per question, each
declared with `@question(...)` (points, the function the learner writes, the kvlib functions it
replaces). They run two ways:

- in the exercise notebook, `check("question_id", learner_function)` runs the question's test
  in-process and prints pass/fail with the test's message: immediate feedback;
- `python -m kvlib.course.grade NOTEBOOK` (`grade_notebook`) grades each question in its own pytest
  subprocess with a timeout. The subprocess loads this module as a pytest plugin, executes the
  notebook's code cells one by one (an error in one cell does not stop the next), makes the kvlib
  functions the question replaces unavailable, and hands the learner's definitions to the test.
  An exception, an infinite loop, `sys.exit`, a missing function or megabytes of printing cost
  that question its points, never the others'.

What it does not do: sandbox untrusted code (learner code runs with the learner's permissions,
on the learner's machine) or grade prose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ENV_GRADING = "KVLIB_GRADING"  # "1" while a notebook is executed by the grader: check() is silent
ENV_SUBMISSION = "KVLIB_SUBMISSION"  # the notebook being graded
ENV_QUESTION = "KVLIB_QUESTION"  # the question being graded
ENV_RESULT = "KVLIB_RESULT"  # where the plugin writes the outcome (JSON)
ENV_CELL_TIMEOUT = "KVLIB_CELL_TIMEOUT"  # seconds one notebook cell may run while loading
MESSAGE_CHARS = 400  # longest message kept per question


class GradingError(RuntimeError):
    """Raised by a kvlib function that is unavailable while the question replacing it is graded."""


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


class Submission:
    """The learner's definitions, as the tests see them."""

    def __init__(self, namespace: dict, errors: list[str] | None = None):
        self.namespace = namespace
        self.errors = errors or []

    def function(self, name: str) -> Callable:
        """The learner's function `name`; fails the question with a clear message if missing."""
        value = self.namespace.get(name)
        if value is None:
            hint = f" The notebook raised while it ran: {self.errors[0]}" if self.errors else ""
            raise AssertionError(
                f"`{name}` is not defined: keep its cell and its name as given.{hint}"
            )
        if not callable(value):
            raise AssertionError(
                f"`{name}` should be a function, but it is a {type(value).__name__}"
            )
        return value


# --- blocking the functions a question asks the learner to write ----------------------------------


@contextlib.contextmanager
def blocked(
    names: tuple[str, ...], question_id: str, namespaces: tuple[dict, ...] = ()
) -> Iterator[None]:
    """Make the kvlib functions `names` raise GradingError when called from outside kvlib's library
    code, everywhere kvlib exposes them and in `namespaces`; restored on exit.

    kvlib's own internal calls (one calculator calling another) still reach the originals. The
    checks (`kvlib.course.checks`) are not patched: they imported the originals as their oracles.
    But a call *from* the checks goes through the stub, so a learner function that is just an alias
    of the blocked function fails. `namespaces` are extra global dicts to patch: `check()` passes
    the learner function's own globals (the notebook's), which imported the originals before
    grading.
    """
    patches = []
    for dotted in names:
        module_name, attribute = dotted.rsplit(".", 1)
        original = getattr(importlib.import_module(module_name), attribute)

        def unavailable(*args, _name=dotted, _original=original, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("kvlib.") and not caller.startswith("kvlib.course.checks"):
                return _original(*args, **kwargs)
            raise GradingError(
                f"{_name} is unavailable while question {question_id!r} is graded: write it "
                "yourself"
            )

        for module in list(sys.modules.values()):
            name = getattr(module, "__name__", "")
            if not name.startswith("kvlib") or name.startswith("kvlib.course.checks"):
                continue  # the checks keep the originals as their oracles
            for key, value in list(vars(module).items()):
                if value is original:
                    patches.append((vars(module), key, value))
        for namespace in namespaces:
            patches.extend((namespace, key, v) for key, v in namespace.items() if v is original)
        for namespace, key, _ in patches:
            if namespace[key] is original:
                namespace[key] = unavailable
    try:
        yield
    finally:
        for namespace, key, value in reversed(patches):
            namespace[key] = value


# --- in the notebook ------------------------------------------------------------------------------


def check(question_id: str, function: Callable) -> bool | None:
    """Run question `question_id`'s test on `function` now and print the verdict.

    The same rules as the grader: the kvlib functions the question replaces are unavailable,
    also through the names the notebook imported them under, so a ✅ here is a pass there.

    Returns True/False (passed or not), or None while the grader executes the notebook (it grades
    every question itself, in isolation).
    """
    if os.environ.get(ENV_GRADING) == "1":
        return None
    for chapter in sorted(
        p.stem.removeprefix("ch") for p in Path(__file__).with_name("checks").glob("ch[0-9]*.py")
    ):
        chapter_questions(chapter)
    if question_id not in _QUESTIONS:
        raise ValueError(
            f"question_id: unknown question {question_id!r}; known: {sorted(_QUESTIONS)}"
        )
    q = _QUESTIONS[question_id]
    learner_globals = getattr(function, "__globals__", None)  # the notebook's namespace
    try:
        with blocked(q.blocked, q.id, () if learner_globals is None else (learner_globals,)):
            q.test(Submission({q.function: function}))
    except Exception as exc:  # the learner's code may raise anything
        print(f"❌ {q.id}: {_describe(exc)}")
        return False
    print(f"✅ {q.id}: passed ({q.points} point{'s' if q.points != 1 else ''})")
    return True


def show(function: Callable, *args, **kwargs) -> None:
    """Call the learner's `function` on an example and print what it returned (or raised).

    The line under each exercise definition: immediate sight of what the code does, before the
    check judges it. Silent while the grader executes the notebook.
    """
    if os.environ.get(ENV_GRADING) == "1":
        return
    name = getattr(function, "__name__", None) or getattr(
        getattr(function, "fn", None), "__name__", repr(function)
    )
    try:
        result = function(*args, **kwargs)
    except Exception as exc:  # the learner's code may raise anything
        text = f"{type(exc).__name__}: {exc}"
        print(
            f"{name}: not written yet"
            if "NotImplementedError" in text
            else f"{name} raised {text[:MESSAGE_CHARS]}"
        )
        return
    print(f"{name} returned {_short(result)}")


def _short(value) -> str:
    """A compact, deterministic rendering of arrays, tensors, tuples and lists."""
    import numpy as np

    if isinstance(value, (tuple, list)):
        inner = ", ".join(_short(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return f"array of shape {value.shape}: " + np.array2string(
            value, precision=4, suppress_small=True, threshold=12, max_line_width=100
        )
    return repr(value)


def _describe(exc: BaseException) -> str:
    text = (
        str(exc)
        if isinstance(exc, AssertionError)
        else f"your code raised {type(exc).__name__}: {exc}"
    )
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


# --- executing a notebook's cells -----------------------------------------------------------------


class CellTimeout(Exception):
    """A notebook cell ran longer than the grader allows."""


def _strip_magics(source: str) -> str:
    """Replace IPython magics and shell escapes with `pass` (they mean nothing outside Jupyter)."""
    if source.lstrip().startswith("%%"):
        return ""
    lines = []
    for line in source.splitlines():
        stripped = line.lstrip()
        lines.append(
            line[: len(line) - len(stripped)] + "pass" if stripped.startswith(("%", "!")) else line
        )
    return "\n".join(lines)


def load_notebook(path: str | os.PathLike, *, cell_timeout_s: float = 20.0) -> Submission:
    """Execute a notebook's code cells in one namespace, each guarded, output discarded.

    Each cell runs on its own: one that raises (even SystemExit) or runs past `cell_timeout_s`
    (where SIGALRM exists) is recorded in `Submission.errors` and the next cell still runs.
    """
    import nbformat

    notebook = nbformat.read(os.fspath(path), as_version=4)
    namespace: dict = {"__name__": "__submission__"}
    errors: list[str] = []
    can_alarm = hasattr(signal, "setitimer") and os.name == "posix"

    def on_alarm(signum, frame):
        raise CellTimeout(f"ran longer than {cell_timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm) if can_alarm else None
    os.environ[ENV_GRADING] = "1"
    try:
        with (
            open(os.devnull, "w") as sink,
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
        ):
            for index, cell in enumerate(notebook.cells):
                if cell.cell_type != "code":
                    continue
                try:
                    code = compile(_strip_magics(cell.source), f"<cell {index}>", "exec")
                    if can_alarm:
                        signal.setitimer(signal.ITIMER_REAL, cell_timeout_s)
                    try:
                        exec(code, namespace)
                    finally:
                        if can_alarm:
                            signal.setitimer(signal.ITIMER_REAL, 0)
                except BaseException as exc:  # noqa: BLE001 - learner code may raise SystemExit too
                    errors.append(f"cell {index}: {type(exc).__name__}: {exc}"[:MESSAGE_CHARS])
    finally:
        if can_alarm:
            signal.signal(signal.SIGALRM, previous)
    return Submission(namespace, errors)


# --- the pytest plugin (loaded with `-p kvlib.course.grading` in the grader's subprocess) --------

if ENV_SUBMISSION in os.environ:  # only inside the grader's subprocess
    import pytest

    @pytest.fixture
    def submission() -> Iterator[Submission]:
        q = _QUESTIONS[os.environ[ENV_QUESTION]]
        with blocked(q.blocked, q.id):
            yield load_notebook(
                os.environ[ENV_SUBMISSION],
                cell_timeout_s=float(os.environ.get(ENV_CELL_TIMEOUT, "20")),
            )

    def pytest_runtest_makereport(item, call) -> None:
        """Write the question's outcome; a skip or an error in any phase counts as a failure."""
        if call.when == "call" or call.excinfo is not None:
            passed = call.excinfo is None
            message = "" if passed else _describe(call.excinfo.value)
            Path(os.environ[ENV_RESULT]).write_text(
                json.dumps({"passed": passed, "message": message})
            )


# --- the grader -----------------------------------------------------------------------------------


@dataclasses.dataclass
class QuestionResult:
    id: str
    passed: bool
    points: int
    message: str


@dataclasses.dataclass
class GradeReport:
    notebook: str
    questions: list[QuestionResult]
    max_points: list[int]  # per question, in the same order

    @property
    def score(self) -> int:
        return sum(q.points for q in self.questions)

    @property
    def max_score(self) -> int:
        return sum(self.max_points)

    def to_json(self) -> dict:
        """The grader's `--json` object.

        Keys: notebook, score, max_score, questions[id, passed, points, message].
        """
        return {
            "notebook": self.notebook,
            "score": self.score,
            "max_score": self.max_score,
            "questions": [dataclasses.asdict(q) for q in self.questions],
        }

    def table(self) -> str:
        """A readable per-question table and the total."""
        width = max([len(q.id) for q in self.questions] + [8])
        lines = [
            f"Grading {self.notebook}",
            f"{'question':<{width}}  result  points  message",
            "-" * (width + 40),
        ]
        for q, max_points in zip(self.questions, self.max_points):
            verdict = "pass" if q.passed else "FAIL"
            lines.append(
                f"{q.id:<{width}}  {verdict:<6}  {q.points:>2}/{max_points:<3}  {q.message}"
            )
        lines.append(f"score: {self.score}/{self.max_score}")
        return "\n".join(lines)


def _grade_question(notebook: Path, q: Question, timeout_s: float) -> QuestionResult:
    """Grade one question in a pytest subprocess; never raises for anything the learner did."""
    test_file = importlib.import_module(f"kvlib.course.checks.{q.chapter}").__file__
    with tempfile.TemporaryDirectory(prefix="kvlib-grade-") as tmp:
        result_path = Path(tmp) / "result.json"
        # PYTEST_DISABLE_PLUGIN_AUTOLOAD: only the grader's plugin; installed ones (hypothesis,
        # nbval, xdist, ...) cost about 1.5 s of imports per question and grade nothing
        env = dict(
            os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"
        )
        env.update(
            {
                ENV_SUBMISSION: str(notebook),
                ENV_QUESTION: q.id,
                ENV_RESULT: str(result_path),
                ENV_CELL_TIMEOUT: str(max(1.0, timeout_s / 3)),
            }
        )
        command = [
            sys.executable,
            "-m",
            "pytest",
            f"{test_file}::test_{q.id}",
            "-p",
            "kvlib.course.grading",
            "-p",
            "no:cacheprovider",
            "-q",
            "--no-header",
            "-o",
            "addopts=",
            "--rootdir",
            tmp,
        ]
        process = subprocess.Popen(
            command,
            env=env,
            cwd=tmp,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=(os.name == "posix"),
        )
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(process)
            return QuestionResult(
                q.id,
                False,
                0,
                f"timed out after {timeout_s:g} s (an infinite loop, or far too slow)",
            )
        if not result_path.exists():
            return QuestionResult(
                q.id,
                False,
                0,
                f"the grading process ended (exit status {process.returncode}) before the test "
                "finished: does the notebook call sys.exit, os._exit or crash Python?",
            )
        outcome = json.loads(result_path.read_text())
        return QuestionResult(
            q.id, bool(outcome["passed"]), q.points if outcome["passed"] else 0, outcome["message"]
        )


def _kill(process: subprocess.Popen) -> None:
    if os.name == "posix":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    else:
        process.kill()
    process.wait()


def grade_notebook(
    notebook: str | os.PathLike, *, timeout_s: float = 60.0, only: list[str] | None = None
) -> GradeReport:
    """Grade an exercise notebook question by question (each in its own subprocess).

    Args:
        notebook: path to `NN_<chapter>.ipynb` (an exercise or a solution notebook).
        timeout_s: seconds each question may take, notebook execution included.
        only: grade just these question ids (default: all of the chapter's).
    Returns:
        A GradeReport.
    Raises:
        FileNotFoundError: no such notebook. ValueError: a chapter without questions, or timeout_s
            <= 0.
    """
    path = Path(notebook).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"notebook: no such file {notebook!s}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    questions = chapter_questions(chapter_of(path))
    if only is not None:
        unknown = sorted(set(only) - {q.id for q in questions})
        if unknown:
            raise ValueError(
                f"only: unknown question ids {unknown}; this chapter has "
                f"{[q.id for q in questions]}"
            )
        questions = [q for q in questions if q.id in only]
    results = [_grade_question(path, q, timeout_s) for q in questions]
    return GradeReport(str(notebook), results, [q.points for q in questions])


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.course.grade NOTEBOOK [--json] [--timeout S]`: exit 0 whenever grading
    ran."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvlib.course.grade", description="Grade a course exercise notebook."
    )
    parser.add_argument("notebook", help="path to exercises/NN_<chapter>.ipynb")
    parser.add_argument(
        "--json", action="store_true", help="print exactly one JSON object instead of a table"
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds allowed per question (default 60)"
    )
    parser.add_argument(
        "--question", action="append", metavar="ID", help="grade only this question (repeatable)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        report = grade_notebook(args.notebook, timeout_s=args.timeout, only=args.question)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))  # exits with status 2
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(report.table())
        print(f"(graded in {time.perf_counter() - started:.1f} s)")
    return 0
