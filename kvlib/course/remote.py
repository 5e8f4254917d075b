"""A learner's function seen from the grader (`Remote`): calling it sends the inputs to the
learner's process by value and returns what came back (`Call`: the result, the arguments after
the call, what was measured), serving meanwhile the rows of an array the grader keeps that the
learner's side asks for; and the helpers the checks use to judge what came back (`expect_list`,
`expect_int`, `expect_tensor`, `peak_allocation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable

import numpy as np

from kvlib.course.wire import Opaque, ParentRows, decode, encode, held


class LearnerRaised(Exception):
    """The learner's function raised (in the learner's process): its type, message, the qualified
    names of its classes (`mro`) and the arguments as they were after it (`args`)."""

    def __init__(self, type_name: str, message: str, mro=(), args_after=None):
        super().__init__(f"your code raised {type_name}: {message}")
        self.type_name, self.mro, self.args_after = type_name, list(mro), args_after

    def is_a(self, name: str) -> bool:
        """Whether the exception is an instance of the built-in exception `name` (a subclass
        counts: `class CacheFull(ValueError)` is a ValueError)."""
        return f"builtins.{name}" in self.mro


class QuestionTimeout(Exception):
    """The learner's process ran past the question's `timeout_s`; the grader killed it."""

    def __init__(self, timeout_s: float):
        super().__init__(f"timed out after {timeout_s:g} s (an infinite loop, or far too slow)")


class ProcessEnded(Exception):
    """The learner's process ended while a call ran (os._exit, a crash, a kill)."""


@dataclasses.dataclass
class Call:
    """One call of the learner's function, seen from the grader: what it returned, its arguments
    after the call (to see mutation), and what was measured. `views` come from memory addresses
    the learner's process reported: flagged, never scored (book/grader_guarantees.md)."""

    result: object
    args: list
    aliases: list[int]  # indices of the arguments the result is, or contains, on the wire
    info: dict
    views: list[int] = dataclasses.field(default_factory=list)  # ... or shares memory with


class Remote:
    """The learner's function `name`: its calls run in the learner's process, by value."""

    def __init__(self, submission, name: str, description: dict, target: str = ""):
        self._submission, self.name, self.description = submission, name, description
        self._target = target or name  # the binding called (the tests grade variants by name)

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs).result

    def call(self, *args, _options: dict | None = None, **kwargs) -> Call:
        """Call with `args`, `kwargs`; `_options`: measure_memory (the peak memory of the call,
        in `info["peak_bytes"]`: the rise inside the call plus what the notebook held beyond the
        grader's own imports when it started; the checks measure two calls on fresh inputs and
        keep the larger peak, `peak_allocation`), torch_ops, grid, and `mutates` (indices of the
        arguments the function is meant to change in place; any other argument it changes fails
        the question, and so does giving one of these new memory) and `may_alias` (the result may
        be, or be a view of, an argument; otherwise that fails the question too)."""
        options = dict(_options or {})
        for index, arg in enumerate(args):
            if isinstance(arg, ParentRows):
                arg.index = index
        return self._finish(args, options, self._exchange(args, kwargs, options))

    def _exchange(self, args, kwargs, options) -> tuple:
        """Send the call, answering the rows the learner's side asks for meanwhile: the reply, its
        info decoded. Peak memory: `side.memory`'s window around the call (less the inputs sent),
        or, where there is none, the learner's process measures itself (said in the hint)."""
        side = self._submission.side  # the channel to the learner's process
        window = getattr(side, "memory", None) if options.get("measure_memory") else None
        if options.get("measure_memory"):
            options["measure_memory"] = "parent" if window is not None else "self"
            options["return_args"] = window is None  # in a window: the result only ("after")
        message = ("call", self._target, list(args), kwargs, options)
        measured: dict = {}
        if hasattr(side, "call_direct"):  # a learner's side in this process (the draws tests)
            reply = side.call_direct(message, lambda ask: _rows_asked(args, ask))
        else:
            if window is not None:
                side.request(("collect",))  # the garbage of earlier calls goes first
                window.open()
            reply = side.request(message, compact=window is not None)
            sent = side.channel.sent_bytes
            while reply[0] == "rows":
                reply = side.request(_rows_asked(args, reply))
            if window is not None:
                peak, fell = window.close()
                held = getattr(window, "held", None)  # None: no baseline to measure it from
                _held_check(self.name, held)
                if fell:
                    raise AssertionError(
                        f"`{self.name}` gave back memory it held before the call while the "
                        "grader measured the call's peak memory: it is measured from what your "
                        "process held when the call started"
                    )
                # what the notebook kept since it loaded counts too: it can be reused inside the
                # call without the peak rising (the fifth red team: 8 MiB kept, 3 and 8 MiB bounds)
                held = max(0, held or 0)
                measured = {"peak_bytes": max(0, peak - sent) + held, "held_bytes": held,
                            "measured_by": "grader"}  # fmt: skip
                if reply[0] == "returned":  # the arguments after the call, out of the window
                    after = side.request(("after",))
                    if after[0] != "returned" or len(after) < 3:
                        raise AssertionError(f"`{self.name}`'s arguments after the call were lost")
                    if not _same_encoding(after[1], reply[1]):  # judged: what the window saw
                        raise AssertionError(
                            f"`{self.name}` sent one result inside the grader's memory window "
                            "and another after it"
                        )
                    reply = (*after[:3], reply[3])
        info = {}
        with contextlib.suppress(ValueError, TypeError, RecursionError):
            info = decode(reply[3]) if len(reply) > 3 else {}
        mine = ("peak_bytes", "held_bytes", "measured_by")  # the grader's alone
        info = {k: v for k, v in info.items() if k not in mine} if type(info) is dict else {}
        info.update(measured)
        if options.get("measure_memory") == "self":  # no window: its own measurements
            peaks = info.get("torch_peak_bytes"), info.get("python_peak_bytes")
            if any(type(peak) is not int or peak < 0 for peak in peaks):
                raise AssertionError(f"`{self.name}`'s memory could not be measured")
            info.update(peak_bytes=sum(peaks), measured_by="your process")
        return (*reply[:3], info, *reply[4:])

    def _finish(self, args, options, reply) -> Call:
        if reply[0] == "raised":
            _, type_name, message, info, mro, args_after = reply
            if "kvlib.course.guards.GradingError" in mro:  # a rule's message says it all
                raise AssertionError(message)
            with contextlib.suppress(ValueError, TypeError, RecursionError):
                args_after = None if args_after is None else decode(args_after)
            raise LearnerRaised(type_name, message, mro, args_after)
        if reply[0] != "returned":
            raise AssertionError(f"the learner's process answered {reply[0]!r}: {reply[1:2]}")
        try:
            refs: list = []
            result = decode(reply[1], refs)
            args_after = decode(reply[2], refs) if reply[2] is not None else list(args)
            inside = {id(part) for part in held(result)}  # the same object on the wire (no numbers)
        except (ValueError, TypeError, RecursionError) as exc:
            raise AssertionError(
                f"`{self.name}` returned a value the grader cannot read: {exc}"
            ) from None
        info = reply[3]
        call = Call(
            result, args_after, [i for i, a in enumerate(args_after) if id(a) in inside], info
        )
        mutates, flag = set(options.get("mutates", ())), self._submission.flag
        views, moved = _reported_memory(info, mutates)
        call.views = [i for i in views if i not in call.aliases]

        def violation(verb: str, index: int, then: str) -> None:  # failed once the checks pass
            argument = f"its argument {index + 1} ({_kind(args[index])})"
            self._submission.violations.append(f"`{self.name}` {verb} {argument} {then}")

        for index, (before, after) in enumerate(zip(args, call.args)):
            if index not in mutates and not _same_value(before, after):
                violation("changed", index, "in place: leave its inputs as they were")
        for index in moved:
            flag(f"`{self.name}` gave its argument {index + 1} new memory (`x.data = ...`): "
                 "write into its own memory, in place")  # fmt: skip
        if not options.get("may_alias") and not options.get("grid"):
            if call.aliases:
                violation("returned", call.aliases[0], "itself: return a new object")
            elif call.views:
                flag(f"`{self.name}` returned a view of its argument {call.views[0] + 1}: "
                     "return a new object")  # fmt: skip
        return call

    def launch(self, grid: tuple, *args, _mutates=(), **kwargs) -> Call:
        """Launch a Triton kernel `kernel[grid](*args, **kwargs)` in the learner's process, under
        Triton's interpreter (CPU tensors). That it is one is the process's word: it words a
        failed launch's message and flags a launch that returned, never the verdict."""
        jit = self.description.get("jit")
        try:
            call = self.call(*args, _options={"grid": tuple(grid), "mutates": _mutates}, **kwargs)
        except LearnerRaised:
            if jit:
                raise
            what = f"`{self.name}` should be a @triton.jit kernel, got a {self.description['type']}"
            raise AssertionError(what) from None
        if not (jit and call.info.get("interpreter")):
            self._submission.flag(f"`{self.name}` is not a kernel run by Triton's interpreter")
        return call


HELD_LIMIT = 16 * 2**20  # what a notebook may hold beyond the grader's own when memory is measured


def _same_encoding(a, b) -> bool:
    """Whether two encoded results (`wire.encode`'s plain data) are the same; too deep to
    compare counts as different."""
    try:
        return a == b
    except RecursionError:
        return False


def _held_check(name: str, held: int | None) -> None:
    """Fail a measured call made while the learner's process held more than `HELD_LIMIT` beyond
    what it held once the grader's own imports (torch, numpy) were done, before its cells ran:
    memory kept since the notebook loaded can be reused inside the call without the peak rising
    (the window sees only a rise), so what a notebook may keep is bounded instead."""
    if held is not None and held > HELD_LIMIT:
        raise AssertionError(
            f"`{name}`'s memory was measured while your notebook held {held / 2**20:.1f} MiB "
            f"beyond the grader's own (buffers or tensors its cells keep, modules they import "
            f"besides torch, numpy and matplotlib): memory kept since the notebook loaded could "
            f"be reused inside the call unseen, so at most {HELD_LIMIT / 2**20:g} MiB may be kept "
            "when a question measures memory: delete what the cells keep (del x), make buffers "
            "inside the function"
        )


def _rows_asked(args, ask: tuple) -> tuple:
    """The grader's answer to the learner's side asking, while a call runs, for rows of an
    argument the grader keeps (`ParentRows`): `("rows", index, start, stop)`."""
    if len(ask) == 4 and all(type(n) is int for n in ask[1:]):
        _, index, start, stop = ask
        rows = args[index] if 0 <= index < len(args) else None
        if isinstance(rows, ParentRows) and 0 <= stop - start <= rows.max_rows:
            return ("rows", encode(rows.rows(start, stop)))
    return ("error", "no such rows")


def _reported_memory(info: dict, mutates: set[int]) -> tuple[list[int], list[int]]:
    """By the memory extents the learner's process reported (a value's: a list of at most 1,024
    (int, int) spans, else none), the arguments the result overlaps and those in `mutates` whose
    memory moved during the call."""
    got = info.get("extents") if type(info.get("extents")) is dict else {}
    was, now = (
        [_spans(v) for v in a[:64]] if type(a) is list else []
        for a in (info.get("extents_before"), got.get("args"))
    )
    out = _spans(got.get("result"))
    views = [i for i, arg in enumerate(now) if any(a < d and c < b for a, b in out for c, d in arg)]
    moved = [i for i in sorted(mutates) if i < min(len(was), len(now)) and was[i] != now[i]]
    return views, [i for i in moved if was[i]]


def _spans(value) -> list:
    def span(p) -> bool:
        return type(p) in (list, tuple) and len(p) == 2 and all(type(x) is int for x in p)

    return value if type(value) is list and len(value) <= 1024 and all(map(span, value)) else []


def expect_list(got, item_ok: Callable[[object], bool], should: str) -> None:
    """Fail unless `got` is a list whose every item passes `item_ok`, with the message `should`
    (what the learner's function should return) followed by what it returned."""
    assert isinstance(got, list) and all(item_ok(item) for item in got), f"{should}, got {got!r}"


def is_int(value) -> bool:
    """Whether `value` counts as an int answer: an int or a numpy integer, not a bool (for the
    items of a list, `expect_list(got, is_int, ...)`)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def expect_int(got, what: str) -> None:
    """Fail unless `got` is an int (`is_int`: a numpy integer counts, a bool or a float not)."""
    assert is_int(got), f"{what} should return an int, got {type(got).__name__} {got!r}"


def expect_tensor(got, expected, name: str) -> None:
    """Fail unless `got` is a torch.Tensor of `expected`'s shape and dtype (values are the
    caller's to compare)."""
    import torch

    kind, shape, dtype = type(got).__name__, tuple(expected.shape), expected.dtype
    assert isinstance(got, torch.Tensor), f"{name}: expected a torch.Tensor, got {kind}"
    assert tuple(got.shape) == shape, f"{name}: expected shape {shape}, got {tuple(got.shape)}"
    assert got.dtype == dtype, f"{name}: expected dtype {dtype} (the inputs' own), got {got.dtype}"


def peak_allocation(info: dict) -> tuple[int, str]:
    """The peak bytes a learner's call held (`_options={"measure_memory": True}`), and a phrase
    for a hint saying what measured it, in MiB."""
    peak, mib = info["peak_bytes"], 2**20
    if info.get("measured_by") == "grader":
        return peak, (
            f"{peak / mib:.1f} MiB (your process's peak memory beyond the grader's own, measured "
            f"from outside it; {info.get('held_bytes', 0) / mib:.1f} MiB of it kept since your "
            "notebook loaded)"
        )
    return peak, (
        f"{peak / mib:.1f} MiB (PyTorch's CPU allocator {info['torch_peak_bytes'] / mib:.1f} MiB + "
        f"numpy/Python {info['python_peak_bytes'] / mib:.1f} MiB, traced in your process)"
    )


def _kind(value) -> str:
    shape = getattr(value, "shape", None)
    return type(value).__name__ + (f" of shape {tuple(shape)}" if shape is not None else "")


def _same_value(a, b) -> bool:
    """Whether `b` (an argument after the call, rebuilt here) still equals `a` (as sent)."""
    torch = sys.modules.get("torch")
    tensor = (torch.Tensor,) if torch is not None else ()
    if not isinstance(a, (list, tuple, dict, set, frozenset, int, float, str, bytes, bool,
                          type(None), np.ndarray, np.generic, *tensor)):  # fmt: skip
        return True  # an object of another type: its state is the test's to judge
    if isinstance(b, Opaque):
        return False  # a plain value that came back as something the grader cannot read
    tol = dict(rtol=0, atol=0, equal_nan=True)
    if tensor and isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        a = a.detach().cpu()
        if a.is_floating_point():  # NaN where it was NaN is unchanged
            return torch.allclose(a, b, **tol)
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        if not (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        return np.allclose(a, b, **tol) if a.dtype.kind in "fc" else np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        if all(type(x) in (int, str, bool, bytes, type(None)) for x in a):
            return a == b  # the common case: a list of plain values
        return all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        same_keys = isinstance(b, dict) and list(a) == list(b)
        return same_keys and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and a == b
