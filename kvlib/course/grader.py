"""The grader: `python -m kvlib.course.grade NOTEBOOK [--json]` (`grade_notebook`, `main`).

Each question is graded against a fresh child process (`kvlib.course.sandbox`) that executes the
notebook's code cells one by one (an error, a hang or an `os._exit` in one cell costs that cell
only: the child is restarted without it). The test, the expected values and the verdict stay here
(`kvlib.course.grading.run_question`); the test's inputs go to the child by value and the outputs
come back by value. A call that raises, hangs (the child is killed from here: no exception to
catch), exits or prints megabytes costs that question its points, never the others'; a question
that leaves a thread running gets the next question a fresh child.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvlib.course.grading import (
    ProcessEnded,
    Question,
    QuestionTimeout,
    chapter_of,
    chapter_questions,
    run_question,
)


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLIB_")}
    # Triton kernels are graded under the interpreter on every machine (CPU tensors, exact)
    env.update(MPLBACKEND="Agg", PYTHONHASHSEED="0", TRITON_INTERPRET="1")
    return env


class _ChildSide:
    """A child process that executed the notebook's cells and serves the test's calls. A cell that
    hangs or ends the process is skipped in a fresh child; a call that does either ends the child
    (killed from here: nothing the learner's code catches) and fails the question."""

    def __init__(
        self,
        cells: list[str],
        deadline: float,
        timeout_s: float,
        cell_timeout_s: float,
        blocked: tuple[str, ...] = (),
        skip: dict[int, str] | None = None,
    ):
        self.cells, self.deadline, self.timeout_s = cells, deadline, timeout_s
        self.blocked = blocked
        skip = {} if skip is None else skip  # cells that ended or hung a child: index -> error
        self.cell_timeout_s = cell_timeout_s
        self.errors: list[str] = []
        self.process = None
        self.skip = set(skip)
        self.errors.extend(skip.values())
        while True:
            self.deadline = time.monotonic() + timeout_s  # each attempt its own window
            failed = self._start(self.skip)
            if failed is None:
                return
            self.skip.add(failed)
            skip[failed] = self.errors[-1]

    def _spawn(self):
        from kvlib.course.wire import Channel

        to_child_r, to_child_w = os.pipe()
        to_grader_r, to_grader_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvlib.course.sandbox", str(to_child_r), str(to_grader_w)],
            pass_fds=(to_child_r, to_grader_w),
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=(os.name == "posix"),
        )
        os.close(to_child_r)
        os.close(to_grader_w)
        self.channel = Channel(to_grader_r, to_child_w, trusted=False)
        self._fds = (to_grader_r, to_child_w)

    def _start(self, skip: set[int]) -> int | None:
        """Start a child and load the notebook; the index of a cell that killed or hung it."""
        from kvlib.course.wire import ChannelClosed, ChannelTimeout

        self._spawn()
        # guards first (inactive until a graded call runs): whatever the notebook copies or
        # re-imports while it loads is a guarded function already
        self.request(("guard", list(self.blocked), ""))
        self.channel.send(("load", self.cells, sorted(skip)))
        expected = [i for i in range(len(self.cells)) if i not in skip]
        for index in expected:
            wait = min(self.cell_timeout_s, self.deadline - time.monotonic())
            try:
                reply = self.channel.recv(max(0.0, wait))
            except ChannelTimeout:
                self.close()
                if self.deadline - time.monotonic() <= 0:
                    raise QuestionTimeout(
                        f"timed out after {self.timeout_s:g} s (an infinite loop, or far too slow)"
                    ) from None
                self.errors.append(f"cell {index}: ran longer than {self.cell_timeout_s:g} s")
                return index
            except ChannelClosed:
                status = self.close()
                self.errors.append(
                    f"cell {index}: ended the Python process (exit status {status}); the grader "
                    "skipped it"
                )
                return index
            if reply[0] != "cell" or reply[1] != index:
                self.close()
                raise ProcessEnded("the notebook's process sent something unexpected")
            if reply[2]:
                self.errors.append(reply[2])
        try:
            self.channel.recv(max(0.0, self.deadline - time.monotonic()))
        except (ChannelTimeout, ChannelClosed):
            self.close()
            raise ProcessEnded("the notebook's process ended after loading") from None
        return None

    def request(self, message):
        from kvlib.course.wire import ChannelClosed, ChannelTimeout

        try:
            self.channel.send(message)
            return self.channel.recv(max(0.0, self.deadline - time.monotonic()))
        except ChannelTimeout:
            self.close()
            raise QuestionTimeout(
                f"timed out after {self.timeout_s:g} s (an infinite loop, or far too slow)"
            ) from None
        except ChannelClosed:
            status = self.close()
            raise ProcessEnded(
                f"the grading process ended (exit status {status}) before the test finished: "
                "does the notebook call sys.exit, os._exit or crash Python?"
            ) from None

    def close(self):
        """Kill the child's whole process group (threads, grandchildren); its exit status."""
        if self.process is None:
            return None
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        try:
            status = self.process.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            status = None
        _kill(self.process)
        self.process = None
        return status if status is not None else "killed"


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


def _grade_questions(cells: list[str], questions: list[Question], timeout_s: float) -> list:
    """Grade `questions` one after the other against a child process that executed the notebook;
    a question that timed out, ended the child or left a thread running gets the next question a
    fresh child. Never raises for anything the learner did."""
    results, side, skip = [], None, {}
    for q in questions:
        try:
            if side is None:
                side = _ChildSide(
                    cells,
                    time.monotonic() + timeout_s,
                    timeout_s,
                    timeout_s / 3,
                    tuple(sorted({name for other in questions for name in other.blocked})),
                    skip,
                )
            side.deadline = time.monotonic() + timeout_s
            passed, message = run_question(q, side, side.errors)
            if side.process is not None and side.request(("status",))[1]["threads"] > 1:
                side.close()
        except (QuestionTimeout, ProcessEnded) as exc:
            passed, message = False, str(exc)
        if side is not None and side.process is None:
            side = None
        results.append(QuestionResult(q.id, passed, q.points if passed else 0, message))
    if side is not None:
        side.close()
    return results


def _kill(process: subprocess.Popen) -> None:
    if os.name == "posix":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    else:
        process.kill()
    process.wait()


def read_code_cells(path: Path) -> list[str]:
    """The sources of a notebook's code cells.

    Raises:
        ValueError: the file is not a Jupyter notebook (one clear usage error).
    """
    try:
        notebook = json.loads(Path(path).read_text(encoding="utf-8"))
        cells = notebook["cells"]
        if not isinstance(cells, list):
            raise TypeError("cells is not a list")
        sources = []
        for cell in cells:
            if cell.get("cell_type") == "code":
                source = cell.get("source", "")
                sources.append("".join(source) if isinstance(source, list) else str(source))
        return sources
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError) as exc:  # fmt: skip
        raise ValueError(
            f"notebook: {Path(path).name} is not a Jupyter notebook (.ipynb JSON with a list of "
            f"cells): {type(exc).__name__}: {exc}"
        ) from None


def grade_notebook(
    notebook: str | os.PathLike, *, timeout_s: float = 60.0, only: list[str] | None = None
) -> GradeReport:
    """Grade an exercise notebook question by question, against a child process that executes it.

    Args:
        notebook: path to `NN_<chapter>.ipynb` (an exercise or a solution notebook).
        timeout_s: seconds each question may take, notebook execution included.
        only: grade just these question ids (default: all of the chapter's).
    Returns:
        A GradeReport.
    Raises:
        FileNotFoundError: no such notebook. ValueError: not a notebook, a chapter without
            questions, or timeout_s <= 0.
    """
    path = Path(notebook).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"notebook: no such file {notebook!s}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    cells = read_code_cells(path)
    questions = chapter_questions(chapter_of(path))
    if only is not None:
        unknown = sorted(set(only) - {q.id for q in questions})
        if unknown:
            raise ValueError(
                f"only: unknown question ids {unknown}; this chapter has "
                f"{[q.id for q in questions]}"
            )
        questions = [q for q in questions if q.id in only]
    results = _grade_questions(cells, questions, timeout_s)
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
