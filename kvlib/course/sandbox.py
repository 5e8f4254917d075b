"""The learner's side of grading: the process that holds the learner's code answers the grader's
requests (`handle_request`, `serve`), each call a graded call (`kvlib.course.guards`), values sent
by value (`kvlib.course.wire`). Two processes serve: the notebook itself, while `check()` waits,
and the grader's child (`python -m kvlib.course.sandbox RFD WFD`, `child_main`), which confines
itself, then executes the notebook's code cells one by one, reporting each.
"""

from __future__ import annotations

import contextlib
import ctypes  # imported now, before the rules apply: its own import opens a library
import gc
import itertools
import linecache
import os
import sys
import threading
import tracemalloc
import types

from kvlib.course.bench import quiet_profiler
from kvlib.course.guards import call_learner, install_guards
from kvlib.course.wire import Channel, ParentRows, encode, extents, safe_text

MESSAGE_CHARS = 400


class CheckTimeout(BaseException):
    """check()'s deadline passed while the learner's function ran in the notebook (a
    BaseException: `except Exception` in learner code does not swallow it)."""


# --- running one call -----------------------------------------------------------------------------


def _fixed_malloc() -> None:
    """glibc's malloc here as in the grader's child (confine.MALLOC_ENV), once per process: a large
    temporary shows in the resident memory the grader reads."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or getattr(_fixed_malloc, "done", False):
        return
    _fixed_malloc.done = True
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 131072)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)


def _measured_in_process(stack: contextlib.ExitStack, info: dict) -> None:
    """Peak allocations measured here (where the grader cannot read this process's memory):
    PyTorch's CPU allocator (its profiler) and numpy/Python's (tracemalloc). `collect` is
    registered first so that it runs last, once the profiler has stopped (its events read
    before that carry no memory)."""

    def collect():
        info["python_peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        # PyTorch's peak: every profiled event's own allocations and frees, in time order
        usage = [e for e in profiler.events() if getattr(e, "self_cpu_memory_usage", 0)]
        changes = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in usage)
        info["torch_peak_bytes"] = max([0, *itertools.accumulate(d for _, d in changes)])

    stack.callback(collect)
    profiler = stack.enter_context(quiet_profiler(profile_memory=True))
    tracemalloc.start()


def _run_call(fn, args, kwargs, options: dict) -> tuple:
    """Call the learner's `fn`, measured as `options` asks. Returns (outcome, info)."""
    info: dict = {"extents_before": [extents(a) for a in args]}
    grid = options.get("grid")
    if grid is not None:  # the grader flags a launch of anything else, never scores it
        info["interpreter"] = _is_triton_kernel(fn, interpreted=True)
    profiler = None
    with contextlib.ExitStack() as stack:
        if options.get("torch_ops"):
            # the profiler records every operator at the dispatcher's entry, composite ones
            # included (torch.ops.aten._scaled_dot_product_attention_math decomposes before a
            # dispatch mode sees it), and torch._C.DisableTorchFunction does not turn it off
            profiler = stack.enter_context(quiet_profiler())
        if options.get("measure_memory"):
            _fixed_malloc()
            if options["measure_memory"] == "self":  # the grader cannot measure from outside
                _measured_in_process(stack, info)
        try:
            result = call_learner(fn, args, kwargs, grid)
        except CheckTimeout:
            raise  # check()'s deadline: the notebook's cell stops here
        except BaseException as exc:  # noqa: BLE001 - report anything, SystemExit included
            return ("raised", type(exc).__name__, safe_text(exc, str)[:MESSAGE_CHARS], exc), info
    if profiler is not None:  # its events, once it stopped
        info["torch_ops"] = sorted({e.name for e in profiler.events()})
    info["extents"] = {"result": extents(result), "args": [extents(a) for a in args]}
    return ("returned", result), info


def _is_triton_kernel(value, interpreted: bool = False) -> bool:
    """A @triton.jit kernel: a JITFunction (unless `interpreted`), or the InterpretedFunction that
    @triton.jit makes of one under TRITON_INTERPRET=1 (wrapping a plain Python function)."""
    jit = getattr(sys.modules.get("triton.runtime.jit"), "JITFunction", ())  # (): no Triton
    wrapper = getattr(sys.modules.get("triton.runtime.interpreter"), "InterpretedFunction", ())
    if not interpreted and isinstance(value, jit):
        return True
    return isinstance(value, wrapper) and isinstance(getattr(value, "fn", None), types.FunctionType)


def _describe(namespace: dict, name: str, question_id: str) -> dict:
    value = namespace.get(name)
    if value is None:
        return {"kind": "missing"}
    is_jit = _is_triton_kernel(value)
    if not callable(value) and not is_jit:
        return {"kind": "not callable", "type": type(value).__name__}
    checking = sys.modules.get("kvlib.course.checking")
    seen = getattr(checking, "CHECKED_WHILE_GRADING", {}).get(question_id)
    return {
        "kind": "callable",
        "type": type(value).__name__,
        "jit": is_jit,
        # whether the notebook's check() cell saw this very object (None: no check() cell ran)
        "checked": None if seen is None else seen is value,
        "defined_in": namespace.get("__kvlib_defined_in__", {}).get(name),
    }


def _mro(exc: BaseException) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__]


_KEPT: list = []  # a measured call's (outcome, arguments, info) until the grader asks ("after")


def handle_request(request, namespace: dict, ask=None):
    """One request of the grader -> its reply (plain data). `ask(message)` sends the grader a
    message during a call and returns its answer."""
    kind = request[0]
    if kind == "describe":
        return ("described", _describe(namespace, request[1], request[2]))
    if kind == "guard":
        _, allowed, question_id = request
        install_guards(tuple(allowed), question_id)
        return ("guarded",)
    if kind == "status":
        return ("status", {"threads": threading.active_count()})
    if kind == "collect":  # before a memory window: what earlier calls left behind goes now
        gc.collect()
        return ("collected",)
    if kind == "imports":  # the grader's own: the memory they take is not the notebook's
        for module in set(request[1]) & {"torch", "numpy", "matplotlib.pyplot"}:
            with contextlib.suppress(Exception):
                __import__(module)
        if "torch.profiler" in request[1]:  # its first start keeps ~80 MiB: the grader's own
            with contextlib.suppress(Exception), quiet_profiler():
                pass
        gc.collect()
        return ("imported",)
    if kind == "after":  # a measured call's result and arguments, out of its window
        if not _KEPT:
            return ("error", "no measured call to answer for")
        (outcome, args, info), options = _KEPT.pop(), {}
    elif kind == "call":
        _, name, args, kwargs, options = request
        _KEPT.clear()
        for value in [*args, *kwargs.values()]:
            if isinstance(value, ParentRows):
                value.ask = ask
        outcome, info = _run_call(namespace.get(name), args, kwargs, options)
        if not options.get("return_args", True) and outcome[0] == "returned":
            _KEPT.append((outcome, args, info))
    if kind in ("call", "after"):
        memo: dict = {}  # the result first, then the arguments: the grader decodes them so
        try:
            encoded = encode(outcome[1], memo) if outcome[0] == "returned" else None
            args_after = encode(list(args), memo) if options.get("return_args", True) else None
            if outcome[0] == "raised":
                return ("raised", outcome[1], outcome[2], encode(info), _mro(outcome[3]),
                        args_after)  # fmt: skip
        except CheckTimeout:
            raise
        except BaseException as exc:  # noqa: BLE001
            message = f"its result could not be read: {safe_text(exc, str)}"
            return ("raised", type(exc).__name__, message, encode(info), _mro(exc), None)
        return ("returned", encoded, args_after, encode(info))
    return ("error", f"unknown request {kind!r}")


def serve(channel: Channel, namespace: dict, *, until: str = "end"):
    """Answer requests until one of kind `until` arrives; returns that request."""

    def ask(message):
        channel.answer(message)
        return channel.next_request()

    while True:
        request = channel.next_request()
        if request[0] == until:
            return request
        channel.answer(handle_request(request, namespace, ask))


# --- the child process: confine, load a notebook, then serve --------------------------------------


def _cell_code(source: str):
    """A cell's source as Python: line magics and shell escapes become `pass`; `%%time`,
    `%%capture` and `%%prun` run their body; other cell magics are refused."""
    stripped = source.lstrip()
    if stripped.startswith("%%"):
        first, _, body = stripped.partition("\n")
        magic = (first[2:].split() or [""])[0]
        if magic not in ("time", "capture", "prun"):
            raise SyntaxError(f"the cell magic %%{magic} is not run by the grader")
        source = "\n" + body  # keep line numbers
    lines = []
    for line in source.splitlines():
        s = line.lstrip()
        lines.append(line[: len(line) - len(s)] + "pass" if s.startswith(("%", "!")) else line)
    return "\n".join(lines)


def _load(channel: Channel, namespace: dict, cells: list[str], skip: set[int], names) -> None:
    """Execute the cells; note the last cell that (re)bound each of `names`."""
    defined = namespace.setdefault("__kvlib_defined_in__", {})
    for index, source in enumerate(cells):
        if index in skip:
            continue
        before = {name: namespace.get(name) for name in names}
        filename = f"<cell {index}>"
        error = None
        try:
            text = _cell_code(source)
            linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
            exec(compile(text, filename, "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001 - learner code may raise SystemExit too
            error = f"cell {index}: {type(exc).__name__}: {safe_text(exc, str)}"[:MESSAGE_CHARS]
        defined.update({name: index for name in names if namespace.get(name) is not before[name]})
        channel.answer(("cell", index, error))


def _confine(read_paths, package: dict | None) -> str:
    """Confine this process before any learner code runs (`kvlib.course.isolation`,
    `kvlib.course.confine`, `kvlib.course.guards`); what took effect, for the report."""
    from kvlib.course import confine, guards, isolation

    user, processes = "the grader's own user", "refused by Python's audit hooks only"
    sight = "kvlib visible, guarded at the Python level only"
    if package and os.geteuid() == 0:
        keep = [os.path.realpath(p) for p in read_paths]
        try:
            sight = isolation.isolate(package["dirs"], package["files"], package["home"], keep)
        except OSError as exc:
            sight = f"kvlib visible (no mount namespace: {exc})"
    if os.name == "posix" and os.geteuid() == 0:
        try:
            user = confine.drop_privileges(read_paths)
            confine.limit_processes(extra=4 * (os.cpu_count() or 1) + 256)
        except OSError as exc:
            user = f"root (could not drop privileges: {exc})"
    with contextlib.suppress(OSError):
        if confine.forbid_processes():
            processes = "refused by the kernel (seccomp) and Python's audit hooks"
    guards.forbid_processes()
    return f"learner code runs as {user}; process creation {processes}; {sight}"


def child_main(read_fd: int, write_fd: int) -> None:
    """The grader's child (its standard streams /dev/null, as the grader starts it): confine
    itself, then load the notebook and serve."""
    channel = Channel(read_fd, write_fd, trusted=True)
    os.environ["KVLIB_GRADING"] = "1"
    # ("confine", what it must read, the notebook's folder, the kvlib it may see or None)
    _, read_paths, folder, package = channel.next_request()
    channel.answer(("confined", _confine(read_paths, package)))
    if folder:
        os.chdir(folder)  # as Jupyter runs a notebook (imports still come from where they were)
    namespace: dict = {"__name__": "__main__"}
    # ("guard", ...) first: whatever the notebook imports is guarded already; ("imports", ...),
    # the grader's memory baseline; then ("load", ...)
    _, cells, skip, names = serve(channel, namespace, until="load")
    _load(channel, namespace, cells, set(skip), names)
    channel.answer(("loaded",))
    serve(channel, namespace)  # until the grader closes the pipes (it sends no "end")


if __name__ == "__main__":
    child_main(int(sys.argv[1]), int(sys.argv[2]))
