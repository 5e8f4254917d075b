"""Exercise checks and the grader.

A chapter's questions are test functions in `kvlib/course/checks/chNN.py`, one per question, each
declared with `@question(...)` (points, the function the learner writes, the kvlib functions it
replaces). The learner's code never runs in the process that holds a test:

- `python -m kvlib.course.grade NOTEBOOK` (`grade_notebook`) grades each question against a fresh
  child process (`kvlib.course.sandbox`) that executes the notebook's code cells one by one (an
  error, a hang or an `os._exit` in one cell costs that cell only: the child is restarted without
  it). The test, the expected values and the verdict stay here; the test's inputs go to the child
  by value and the outputs come back by value (plain data, rebuilt without running anything from
  the child). A call that raises, hangs (the child is killed from here: no exception to catch),
  exits or prints megabytes costs that question its points, never the others'.
- in the exercise notebook, `check("question_id", learner_function)` starts the same grader in a
  subprocess, which runs the same test with the same protocol against the notebook's process:
  the two verdicts cannot differ.

The kvlib functions a question replaces are unavailable to the learner's code while a graded call
runs (blocking by provenance, see `kvlib.course.sandbox`), and so are the check modules'.

What the learner's process measures (the torch operators a call ran, its peak allocations, the
reads a RowReadCounter counted, whether a result aliases an input) is measured there, by code
that the learner's code could patch; what it cannot reach is the test, the expected values and the
verdict. Nor does the grader sandbox the machine (learner code runs with the learner's
permissions, on the learner's machine) or grade prose. check() enforces no timeout in the
notebook: its grader gives up after 60 s, the cell runs until interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ENV_GRADING = "KVLIB_GRADING"  # "1" while a notebook is executed by the grader: check() is silent
MESSAGE_CHARS = 400  # longest message kept per question


from kvlib.course.sandbox import GradingError  # noqa: E402,F401 (raised in the learner's process)


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

# Everything in kvlib that computes a cache's bytes: a question about bytes blocks all of it (a
# "twin" such as cache_report(...).total_bytes would answer kv_cache_bytes's question).
MEMORY_API = (
    "kvlib.memory.formula.dense_kv_cache_bytes",
    "kvlib.memory.formula.kv_elements_per_token",
    "kvlib.memory.kv_bytes_per_token",
    "kvlib.memory.kv_cache_bytes",
    "kvlib.memory.cache_report",
    "kvlib.memory.layer_specs",
    "kvlib.memory.memory_budget",
    "kvlib.memory.max_concurrent_sequences",
    "kvlib.memory.equation.quantized_kv_cache_bytes",
    "kvlib.quant.QuantScheme.bytes_per_vector",
)
# Everything in kvlib that computes rotary embeddings
ROPE_API = (
    "kvlib.layers.llama.apply_rope",
    "kvlib.layers.llama.rope_cos_sin",
    "kvlib.layers.llama.rope_inverse_frequencies",
    "kvlib.layers.llama.rotate_half",
)
# Everything in kvlib that computes attention (torch's SDPA is detected separately)
ATTENTION_API = (
    "kvlib.ops.attention.grouped_attention",
    "kvlib.ops.attention.reference_attention",
    "kvlib.ops.attention.sdpa_attention",
    "kvlib.cache.paged.paged_attention",
    "kvlib.kernels.paged_decode_attention",
    "kvlib.kernels.paged_decode_attention_ref",
    "kvlib.ref.attention.attention",
    "kvlib.ref.attention.softmax",
)


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
        from kvlib.course.sandbox import decode

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

    from kvlib.course.sandbox import Opaque

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


# --- in the notebook ------------------------------------------------------------------------------


class _OnlyFunction(dict):
    """check()'s namespace: the one function, under whatever name the question asks for."""

    def __init__(self, function):
        super().__init__()
        self._function = function

    def get(self, name, default=None):
        return self._function


def check(question_id: str, function: Callable) -> bool | None:
    """Run question `question_id`'s test on `function` now and print the verdict.

    The grader's own machinery: a grader subprocess holds the test, the expected values and the
    verdict, and sends the test's inputs here, where `function` runs (with the same kvlib
    functions unavailable); so a ✅ here is a pass there. The timeout is the grader's only.

    Returns True/False (passed or not), or None while the grader executes the notebook (it grades
    every question itself, in isolation).
    """
    if os.environ.get(ENV_GRADING) == "1":
        return None
    from kvlib.course.sandbox import Channel, ChannelClosed, serve

    global _CHECKER
    if _CHECKER is None or _CHECKER[0].poll() is not None:
        # one grader subprocess serves this notebook's checks (its imports are paid once)
        to_grader_r, to_grader_w = os.pipe()
        to_learner_r, to_learner_w = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "-m", "kvlib.course.grading", "--peer", str(to_grader_r),
             str(to_learner_w)],
            pass_fds=(to_grader_r, to_learner_w),
            env=_child_env(),
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_grader_r)
        os.close(to_learner_w)
        _CHECKER = (process, Channel(to_learner_r, to_grader_w, trusted=True))
    process, channel = _CHECKER
    try:
        channel.send(("question", question_id))
        verdict = serve(channel, _OnlyFunction(function), until="verdict")
    except ChannelClosed:
        _stop_checker()
        verdict = ("verdict", False, "the grader ended unexpectedly", 0)
    except BaseException:  # an interrupt mid-question: the next check starts a fresh grader
        _stop_checker()
        raise
    _, passed, message, points = verdict
    if passed is None:
        raise ValueError(message)
    if passed:
        print(f"✅ {question_id}: passed ({points} point{'s' if points != 1 else ''})")
        return True
    print(f"❌ {question_id}: {message}")
    return False


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

    def __init__(self, channel, deadline: float):
        self.channel, self.deadline = channel, deadline

    def request(self, message):
        from kvlib.course.sandbox import ChannelClosed, ChannelTimeout

        self.channel.send(message)
        try:
            return self.channel.recv(max(0.0, self.deadline - time.monotonic()))
        except ChannelTimeout:
            raise QuestionTimeout(
                f"timed out after {self.timeout_s:g} s (an infinite loop, or far too slow)"
            ) from None
        except ChannelClosed:
            raise ProcessEnded("the notebook's process ended") from None


def _peer_main(read_fd: int, write_fd: int, timeout_s: float = 60.0) -> None:
    """check()'s grader subprocess: for each question the notebook asks for, run its test against
    the notebook and send the verdict; ends when the notebook goes, or after a timeout (the
    notebook's side is then out of step)."""
    from kvlib.course.sandbox import Channel, ChannelClosed

    channel = Channel(read_fd, write_fd, trusted=False)
    while True:
        try:
            request = channel.recv()
        except ChannelClosed:
            return
        if not (isinstance(request, tuple) and len(request) == 2 and request[0] == "question"):
            return
        try:
            q = _find_question(str(request[1]))
        except ValueError as exc:
            channel.send(("verdict", None, str(exc), 0))
            continue
        side = _PeerSide(channel, time.monotonic() + timeout_s)
        side.timeout_s = timeout_s
        try:
            passed, message = run_question(q, side, [])
        except (QuestionTimeout, ProcessEnded) as exc:
            with contextlib.suppress(Exception):
                channel.send(("verdict", False, str(exc), q.points))
            return
        channel.send(("verdict", passed, message, q.points))


def _find_question(question_id: str) -> Question:
    files = sorted(Path(__file__).with_name("checks").glob("ch[0-9]*.py"))
    # import only the chapter that defines it (each chapter's imports cost seconds)
    owners = [p for p in files if f"def test_{question_id}(" in p.read_text(encoding="utf-8")]
    for path in owners or files:
        chapter_questions(path.stem.removeprefix("ch"))
    if question_id not in _QUESTIONS:
        raise ValueError(
            f"question_id: unknown question {question_id!r}; known: {sorted(_QUESTIONS)}"
        )
    return _QUESTIONS[question_id]


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


# --- the learner's child process, seen from the grader -----------------------------------------


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLIB_")}
    env.update(MPLBACKEND="Agg", PYTHONHASHSEED="0")
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
        from kvlib.course.sandbox import Channel

        to_child_r, to_child_w = os.pipe()
        to_grader_r, to_grader_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvlib.course.sandbox", str(to_child_r), str(to_grader_w)],
            pass_fds=(to_child_r, to_grader_w),
            env=_child_env(),
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
        from kvlib.course.sandbox import ChannelClosed, ChannelTimeout

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
        from kvlib.course.sandbox import ChannelClosed, ChannelTimeout

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


if __name__ == "__main__" and len(sys.argv) >= 4 and sys.argv[1] == "--peer":
    # check()'s grader: run as the imported module, where the checks register their questions
    from kvlib.course import grading as _grading

    # an interrupted or shut-down notebook kernel signals its whole process group: this process
    # then ends as it would when the notebook goes, without a traceback on the notebook's stderr
    with contextlib.suppress(KeyboardInterrupt):
        _grading._peer_main(int(sys.argv[2]), int(sys.argv[3]))
