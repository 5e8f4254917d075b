"""The grader: `python -m kvlib.course.grade NOTEBOOK [--json] [--seed N]` (`grade_notebook`,
`main`).

Each question is graded against a child process (`kvlib.course.child`) that executed the
notebook's code cells, each within `timeout_s`; each question's test may then run `timeout_s`. The
test, the expected values and the verdict stay here (`kvlib.course.grading.run_question`). A call
that raises, hangs, exits or prints megabytes costs that question its points, never the others'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import sys
import time
import traceback
from pathlib import Path

from kvlib.course.child import _ChildSide
from kvlib.course.grading import (
    ProcessEnded,
    Question,
    QuestionTimeout,
    chapter_of,
    chapter_questions,
    run_question,
)


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
    seed: int = 0
    nonce: str = ""
    sandbox: str = ""

    @property
    def score(self) -> int:
        return sum(q.points for q in self.questions)

    @property
    def max_score(self) -> int:
        return sum(self.max_points)

    def to_json(self) -> dict:
        """The grader's `--json` object: notebook, score, max_score, questions[id, passed, points,
        message], seed (replay with --seed), nonce (KVLIB_GRADE_NONCE, or drawn), sandbox (what
        confined the learner's code)."""
        fields = dataclasses.asdict(self)  # notebook, questions, max_points, seed, nonce, sandbox
        del fields["max_points"]
        totals = {"score": self.score, "max_score": self.max_score}
        return {"notebook": self.notebook, **totals, **fields}

    def table(self) -> str:
        """A readable per-question table and the total."""
        width = max([len(q.id) for q in self.questions] + [8])
        lines = [
            f"Grading {self.notebook} (random cases: seed {self.seed}; nonce {self.nonce})",
            f"{'question':<{width}}  result  points  message",
            "-" * (width + 40),
        ]
        for q, max_points in zip(self.questions, self.max_points):
            verdict = "pass" if q.passed else "FAIL"
            # learner text on one line, control characters escaped: it cannot add a row or a score
            message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(q.message))
            lines.append(f"{q.id:<{width}}  {verdict:<6}  {q.points:>2}/{max_points:<3}  {message}")
        lines.append(f"score: {self.score}/{self.max_score}")
        if self.sandbox:
            lines.append(f"({self.sandbox})")
        return "\n".join(lines)


def _grade_questions(cells: list[str], jobs: list[tuple[Question, str]], timeout_s: float,
                     seed: int, folder: str | None = None) -> tuple[list, str]:  # fmt: skip
    """Grade each (question, binding) of `jobs` in turn against a child that executed the notebook
    (a fresh one after a question that timed out, ended it or left a thread running); never raises
    for anything the learner did. Returns the results and what confined the child."""
    results, side, skip, confinement = [], None, {}, ""
    names = sorted({binding or q.function for q, binding in jobs})
    allowed = tuple(sorted({name for q, _ in jobs for name in q.allowed}))
    profiled = any(q.torch_ops for q, _ in jobs)  # the profiler started before the notebook loads
    for q, binding in jobs:
        try:
            if side is None:
                side = _ChildSide(cells, timeout_s, names, folder, skip, allowed, profiled)
                confinement = side.confinement
            side.deadline = time.monotonic() + timeout_s
            passed, message = run_question(q, side, side.errors, seed, binding=binding)
            if side.process is not None and _threads(side) > 1:
                side.close()
        except (QuestionTimeout, ProcessEnded) as exc:
            passed, message = False, str(exc)
        except Exception as exc:  # noqa: BLE001 - what the learner's process sent, unreadable
            if side is not None:
                side.close()
            passed = False
            message = f"the grader could not read your process's answer ({type(exc).__name__})"
        if side is not None and side.process is None:
            side = None
        results.append(QuestionResult(q.id, passed, q.points if passed else 0, message))
    if side is not None:
        side.close()
    return results, confinement


def _threads(side: _ChildSide) -> int:
    """The child's thread count; a reply that is not one fails the question (ProcessEnded). Its
    answer is also the last of the question: anything the child sent since shows here."""
    reply = side.request(("status",))
    threads = reply[1].get("threads") if len(reply) == 2 and type(reply[1]) is dict else None
    if reply[0] != "status" or type(threads) is not int:
        side.close()
        raise ProcessEnded("your process answered the grader's last request out of turn")
    return threads


def read_code_cells(path: Path) -> list[str]:
    """The sources of a notebook's code cells.

    Raises:
        ValueError: the file is not a Jupyter notebook (one clear usage error).
    """
    try:
        cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
        if not isinstance(cells, list):
            raise TypeError("cells is not a list")
        sources = [cell.get("source", "") for cell in cells if cell.get("cell_type") == "code"]
        return ["".join(source) if isinstance(source, list) else str(source) for source in sources]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError) as exc:  # fmt: skip
        raise ValueError(
            f"notebook: {Path(path).name} is not a Jupyter notebook (.ipynb JSON with a list of "
            f"cells): {type(exc).__name__}: {exc}"
        ) from None


def grade_notebook(
    notebook: str | os.PathLike,
    *,
    timeout_s: float = 60.0,
    only: list[str] | None = None,
    seed: int | None = None,
    nonce: str | None = None,
) -> GradeReport:
    """Grade an exercise notebook question by question, against a child process that executes it.

    Args:
        notebook: path to `NN_<chapter>.ipynb` (an exercise or a solution notebook).
        timeout_s: seconds each cell may run while the notebook loads, and each question's test.
        only: grade just these question ids (default: all of the chapter's).
        seed: the random cases' seed (default: drawn afresh); the report says which.
        nonce: carried by the report (default: KVLIB_GRADE_NONCE, or drawn); never sent to the
            child.
    Raises:
        FileNotFoundError: no such notebook. ValueError: not a notebook, a chapter without
            questions, or timeout_s <= 0.
    """
    folder, cells, questions, seed = _prepare(notebook, timeout_s, seed)
    if only is not None:
        unknown = sorted(set(only) - {q.id for q in questions})
        if unknown:
            raise ValueError(
                f"only: unknown question ids {unknown}; this chapter has "
                f"{[q.id for q in questions]}"
            )
        questions = [q for q in questions if q.id in only]
    if nonce is None:
        nonce = os.environ.get("KVLIB_GRADE_NONCE") or secrets.token_hex(8)
    jobs = [(q, "") for q in questions]  # each question's own function
    results, confinement = _grade_questions(cells, jobs, timeout_s, seed, folder)
    points = [q.points for q in questions]
    return GradeReport(str(notebook), results, points, seed, nonce, confinement)


def grade_bindings(
    notebook: str | os.PathLike, question_id: str, names: list[str], *,
    timeout_s: float = 60.0, seed: int | None = None,
) -> list[QuestionResult]:  # fmt: skip
    """Grade question `question_id` once per function name in `names`, all defined by the
    notebook, against one child process (the grading tests grade many answers this way)."""
    folder, cells, questions, seed = _prepare(notebook, timeout_s, seed)
    (q,) = [q for q in questions if q.id == question_id]
    return _grade_questions(cells, [(q, name) for name in names], timeout_s, seed, folder)[0]


def _prepare(notebook, timeout_s: float, seed: int | None) -> tuple:
    """(the notebook's folder, its code cells, its chapter's questions, the seed or one drawn)."""
    path = Path(notebook).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"notebook: no such file {notebook!s}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    seed = secrets.randbelow(2**32) if seed is None else int(seed)
    return str(path.parent), read_code_cells(path), chapter_questions(chapter_of(path)), seed


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.course.grade NOTEBOOK [--json] [--timeout S] [--seed N]`: exit 0 when
    grading ran to its end, 2 on a usage error, 3 (and no score) when the grader failed."""
    parser = argparse.ArgumentParser(
        prog="python -m kvlib.course.grade",
        description="Grade a course exercise notebook. Read the exit status (0: graded) and the "
        "report; set KVLIB_GRADE_NONCE to a secret of yours and check the JSON carries it.",
    )
    parser.add_argument("notebook", help="path to exercises/NN_<chapter>.ipynb")
    parser.add_argument(
        "--json", action="store_true", help="print exactly one JSON object instead of a table"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds allowed per question's test, and per cell while the notebook loads "
        "(default 60)",
    )
    parser.add_argument(
        "--question", action="append", metavar="ID", help="grade only this question (repeatable)"
    )
    parser.add_argument(
        "--seed",
        help="the random cases' seed (default: drawn; the report says which); '-': read it from "
        "standard input, where the learner's process cannot see it (a command line can be)",
    )
    args = parser.parse_args(argv)
    if args.seed is not None:
        text = sys.stdin.readline().strip() if args.seed == "-" else args.seed
        try:
            args.seed = int(text)
        except ValueError:
            parser.error(f"--seed: expected an integer, got {text!r}")
    started = time.perf_counter()
    try:
        report = grade_notebook(
            args.notebook, timeout_s=args.timeout, only=args.question, seed=args.seed
        )
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))  # exits with status 2
    except Exception:  # noqa: BLE001 - the grader failed: no score, a non-zero status
        traceback.print_exc()
        print("grading failed: no score", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(report.to_json()), flush=True)
    else:
        print(report.table())
        print(f"(graded in {time.perf_counter() - started:.1f} s)", flush=True)
    return 0
