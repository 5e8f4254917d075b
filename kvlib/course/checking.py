"""The exercise notebook's side of grading: `check("question_id", function)` and `show(function,
...)`.

check() starts a grader subprocess (one per notebook kernel, `python -I`: no PYTHONPATH, no user
site-packages) that runs the question with the grader's own `run_question`; this process serves
its requests (`kvlib.course.sandbox`), so the learner's function runs here, under the grader's
rules and limits: past `timeout_s` an alarm raises `CheckTimeout` (`_deadline`); in Jupyter, a
function whose defining cell ran longer than the grader gives a cell fails, as the grader skips
that cell. Each check() draws its own random cases.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvlib.course.child import child_env
from kvlib.course.grading import (
    _QUESTIONS,
    ENV_GRADING,
    MESSAGE_CHARS,
    ProcessEnded,
    QuestionTimeout,
    chapter_questions,
    run_question,
)
from kvlib.course.memory_window import PeakMemory, memory_window
from kvlib.course.sandbox import CheckTimeout, serve
from kvlib.course.wire import Channel, ChannelClosed, ChannelTimeout, Unsolicited

# question id -> the function the notebook's check() cell passed, while the grader runs it
CHECKED_WHILE_GRADING: dict[str, object] = {}
# (cell source, seconds) of each cell Jupyter ran since this module was imported
CELL_SECONDS: list[tuple[str, float]] = []

# check()'s grader subprocess, started with `python -I`: kvlib from the installed packages, or,
# for a clone that is not installed, from the folder holding it (appended: it shadows nothing)
_PEER = (
    "import contextlib, importlib.util, os, sys\n"
    "if importlib.util.find_spec('kvlib') is None:\n"
    "    sys.path.append(sys.argv[1])\n"
    "from kvlib.course import checking\n"
    "# an interrupted or shut-down notebook signals its process group: end without a traceback\n"
    "with contextlib.suppress(KeyboardInterrupt):\n"
    "    checking._peer_main(int(sys.argv[2]), int(sys.argv[3]))\n"
)


class _OnlyFunction(dict):
    """check()'s namespace: the one function, under whatever name the question asks for."""

    def __init__(self, function):  # an empty dict, whatever is asked of it
        self._function = function

    def get(self, name, default=None):
        return default if name.startswith("__kvlib") else self._function


def check(
    question_id: str, function: Callable, *, timeout_s: float = 60.0, seed: int | None = None
) -> None:
    """Run question `question_id`'s test on `function` now, as the grader would, and print the
    verdict (returns None). Past `timeout_s` (the grader's limit per question, and per cell
    while it loads the notebook) the function is stopped and the check fails. `seed`: the random
    cases (default: drawn afresh; a failure says which). Silent while the grader executes the
    notebook (it grades every question itself).

    Raises:
        ValueError: no question `question_id`.
    """
    if os.environ.get(ENV_GRADING) == "1":
        CHECKED_WHILE_GRADING[question_id] = function
        return
    # the grader skips a cell that runs past timeout_s while it loads the notebook
    name = getattr(function, "__name__", None) or getattr(getattr(function, "fn", None),
                                                          "__name__", None)  # fmt: skip
    seconds = [s for source, s in CELL_SECONDS if f"def {name}(" in source or f"{name} =" in source]
    if name and seconds and seconds[-1] > timeout_s:  # the last cell that defines it
        print(
            f"❌ {question_id}: `{name}` is not defined for the grader: the cell that defines it "
            f"ran {seconds[-1]:.0f} s, longer than the {timeout_s:g} s the grader gives a cell "
            "while it loads the notebook (it skips the cell)"
        )
        return
    seed = secrets.randbelow(2**32) if seed is None else seed
    global _CHECKER
    if _CHECKER is None or _CHECKER[0].poll() is not None:
        # one grader subprocess serves this notebook's checks (its imports are paid once)
        to_grader_r, to_grader_w = os.pipe()
        to_learner_r, to_learner_w = os.pipe()
        kvlib_parent = str(Path(__file__).resolve().parents[2])
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", _PEER, kvlib_parent, str(to_grader_r), str(to_learner_w)],
            pass_fds=(to_grader_r, to_learner_w),
            env={**child_env(), "KVLIB_CHECK_PEER": "1"},  # the grader's side: nothing to guard
            stdin=subprocess.DEVNULL,
        )
        os.close(to_grader_r)
        os.close(to_learner_w)
        _CHECKER = (process, Channel(to_learner_r, to_grader_w, trusted=True))
    process, channel = _CHECKER
    try:
        with _deadline(timeout_s, CheckTimeout):
            channel.answer(("question", question_id, float(timeout_s), int(seed)))
            verdict = serve(channel, _OnlyFunction(function), until="verdict")
    except (CheckTimeout, ChannelClosed) as exc:  # the grader is out of step: a fresh one next
        _stop_checker()
        late = isinstance(exc, CheckTimeout)
        message = str(QuestionTimeout(timeout_s)) if late else "the grader ended unexpectedly"
        verdict = ("verdict", False, message, 0)
    except BaseException:  # an interrupt mid-question: the next check starts a fresh grader
        _stop_checker()
        raise
    _, passed, message, points = verdict
    if passed is None:
        raise ValueError(message)
    if passed:
        note = f" {message}" if message else ""
        print(f"✅ {question_id}: passed ({points} point{'s' if points != 1 else ''}){note}")
        return
    print(f"❌ {question_id}: {message}")


def record_cell_time(source: str, seconds: float) -> None:
    """Note that a cell with `source` ran `seconds` (Jupyter's post_run_cell does, once this
    module is imported in a notebook)."""
    CELL_SECONDS.append((source, float(seconds)))


def _watch_cells() -> None:
    """In Jupyter (IPython imported, a shell running), time each cell from now on
    (record_cell_time)."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is None or getattr(shell, "_kvlib_cells_timed", False):
        return
    shell._kvlib_cells_timed = True
    started: dict = {}

    def pre_run_cell(info=None):
        started.update(at=time.monotonic(), source=getattr(info, "raw_cell", "") or "")

    def post_run_cell(result=None):
        if "at" in started:
            record_cell_time(started.pop("source"), time.monotonic() - started.pop("at"))

    shell.events.register("pre_run_cell", pre_run_cell)
    shell.events.register("post_run_cell", post_run_cell)


@contextlib.contextmanager
def _deadline(timeout_s: float, error: type):
    """Raise `error` in this thread once `timeout_s` have passed, and every 0.5 s after while the
    block still runs (learner code that catches it once does not keep it). Only in the main
    thread of a POSIX process (SIGALRM); elsewhere the block runs without a deadline."""
    if not (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()):
        yield
        return

    def on_alarm(signum, frame):
        raise error(f"check() ran past {timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(timeout_s, 1e-3), 0.5)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_CHECKER = None  # check()'s grader subprocess and its channel


def _stop_checker() -> None:
    global _CHECKER
    if _CHECKER is not None:
        process, channel = _CHECKER
        _CHECKER = None
        for fd in (channel.read_fd, channel.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(Exception):
            process.kill()
            process.wait()


class _PeerSide:
    """The learner's side as seen by check()'s grader subprocess: the notebook process."""

    def __init__(self, channel, timeout_s: float):
        self.channel, self.timeout_s = channel, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.memory = memory_window(os.getppid(), (PeakMemory,))  # the notebook's: it can reset it

    def request(self, message, *, compact: bool = False):
        try:
            wait = max(0.0, self.deadline - time.monotonic())
            return self.channel.request(message, wait, compact=compact)
        except ChannelTimeout:
            raise QuestionTimeout(self.timeout_s) from None
        except Unsolicited as exc:
            raise ProcessEnded(str(exc)) from None
        except ChannelClosed:
            raise ProcessEnded("the notebook's process ended") from None


def _peer_main(read_fd: int, write_fd: int, timeout_s: float = 65.0) -> None:
    """check()'s grader subprocess: for each question the notebook asks for, run its test against
    the notebook and send the verdict; ends when the notebook goes, or after a timeout (the
    notebook's side is then out of step)."""
    channel = Channel(read_fd, write_fd, trusted=False)
    while True:
        try:
            frame = channel.recv()
        except ChannelClosed:
            return
        request = frame[1] if type(frame) is tuple and len(frame) == 2 else None
        if not (type(request) is tuple and len(request) == 4 and request[0] == "question"):
            return
        _, question_id, limit, seed = request
        if isinstance(limit, float) and limit > 0:
            timeout_s = limit + 5.0  # the notebook's own deadline comes first
        question_id = str(question_id)
        files = sorted(Path(__file__).with_name("checks").glob("ch[0-9]*.py"))
        # import only the chapter that defines it (each chapter's imports cost seconds)
        owners = [p for p in files if f"def test_{question_id}(" in p.read_text(encoding="utf-8")]
        for path in owners or files:
            chapter_questions(path.stem.removeprefix("ch"))
        q = _QUESTIONS.get(question_id)
        if q is None:
            message = f"question_id: unknown question {question_id!r}; known: {sorted(_QUESTIONS)}"
            channel.tell(("verdict", None, message, 0))
            continue
        side = _PeerSide(channel, timeout_s)
        try:
            passed, message = run_question(q, side, [], int(seed))
        except (QuestionTimeout, ProcessEnded) as exc:
            with contextlib.suppress(Exception):
                channel.tell(("verdict", False, str(exc), q.points))
            return
        channel.tell(("verdict", passed, message, q.points))


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
        unwritten = "NotImplementedError" in text
        print(f"{name}: not written yet" if unwritten else f"{name} raised {text[:MESSAGE_CHARS]}")
        return
    print(f"{name} returned {_short(result)}")


def _short(value) -> str:
    """A compact, deterministic rendering of arrays, tensors, tuples and lists."""
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


_watch_cells()
# kvlib guarded from the notebook's import of check() on: a process it forks later (a pool made
# while it runs) then obeys the same rules while a check() runs
if os.environ.get(ENV_GRADING) != "1" and not os.environ.get("KVLIB_CHECK_PEER"):
    from kvlib.course.guards import install_guards

    install_guards((), "")
