"""The learner's side of grading: a process that holds the learner's code, receives a test's inputs
and returns the outputs by value (`kvlib.course.wire`). The grader (`kvlib.course.grading`) keeps
the tests, the expected values and the verdict in its own process, which the learner's code cannot
reach.

Two servers answer the grader's requests, with the same `handle_request`:
- the grader's child process (`python -m kvlib.course.sandbox RFD WFD`), which first executes a
  notebook's code cells one by one, reporting each cell as it finishes (so a cell that ends the
  process or hangs costs only itself: the grader restarts the child without it);
- the notebook itself, while `check()` waits for the grader subprocess it started.

A call runs with the question's kvlib functions blocked (`kvlib.course.guards`) and measured as the
test asks (the torch operators it ran, its peak allocations, whether its result aliases an input).
"""

from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import sys
import types

from kvlib.course.guards import GradingError, call_learner, install_guards
from kvlib.course.wire import (  # noqa: F401 (the protocol's names, importable from here)
    Channel,
    ChannelClosed,
    ChannelTimeout,
    Opaque,
    decode,
    encode,
)

__all__ = ["GradingError", "CheckTimeout", "handle_request", "serve", "child_main"]

MESSAGE_CHARS = 400


class CheckTimeout(BaseException):
    """check()'s deadline passed while the learner's function ran in the notebook (a
    BaseException: `except Exception` in learner code does not swallow it)."""


def _buffers(value, found: list, depth: int = 0) -> list:
    """(start, end) byte ranges of the tensors and arrays in `value` (containers searched)."""
    import numpy as np

    if depth > 4:
        return found
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        with contextlib.suppress(Exception):
            storage = value.untyped_storage()
            found.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    elif isinstance(value, np.ndarray):
        with contextlib.suppress(Exception):
            low, high = np.lib.array_utils.byte_bounds(value)
            found.append((low, high))
    elif isinstance(value, (list, tuple)):
        for v in value[:1000]:
            _buffers(v, found, depth + 1)
    elif isinstance(value, dict):
        for v in list(value.values())[:1000]:
            _buffers(v, found, depth + 1)
    return found


def _aliases(result, args) -> list[int]:
    """Indices of the arguments that `result` is, contains, or shares memory with."""
    hits = []
    result_buffers = _buffers(result, [])
    for index, arg in enumerate(args):
        if result is arg and not isinstance(arg, (int, float, str, bool, type(None))):
            hits.append(index)
            continue
        arg_buffers = _buffers(arg, [])
        if any(a0 < b1 and b0 < a1 for a0, a1 in result_buffers for b0, b1 in arg_buffers):
            hits.append(index)
    return hits


# --- running one call -----------------------------------------------------------------------------


def _torch_peak_bytes(events) -> int:
    """Peak of PyTorch's CPU allocations over a profiled call: every event's own allocations and
    frees, in time order."""
    changes = sorted(
        (e.time_range.start, e.self_cpu_memory_usage)
        for e in events
        if getattr(e, "self_cpu_memory_usage", 0)
    )
    peak = current = 0
    for _, delta in changes:
        current += delta
        peak = max(peak, current)
    return peak


def _silence_stderr(stack: contextlib.ExitStack) -> None:
    """Send file descriptor 2 to /dev/null until `stack` closes (torch's profiler writes its
    warnings there, not through Python's sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    stack.callback(os.close, devnull)
    stack.callback(os.close, saved)
    stack.callback(os.dup2, saved, 2)


def _run_call(fn, args, kwargs, options: dict) -> tuple:
    """Call the learner's `fn`, measured as `options` asks. Returns (outcome, info)."""
    info: dict = {}
    grid = options.get("grid")
    if grid is not None:
        if not _is_triton_kernel(fn):
            return (
                "raised",
                "TypeError",
                f"expected a @triton.jit kernel, got a {type(fn).__name__}",
            ), info
        interpreter = sys.modules.get("triton.runtime.interpreter")
        info["interpreter"] = interpreter is not None and isinstance(
            fn, interpreter.InterpretedFunction
        )
    stack = contextlib.ExitStack()
    ops: set = set()
    profiler = None
    with stack:
        if options.get("torch_ops"):
            # the profiler records every operator at the dispatcher's entry, composite ones
            # included (torch.ops.aten._scaled_dot_product_attention_math decomposes before a
            # dispatch mode sees it), and torch._C.DisableTorchFunction does not turn it off
            from torch.profiler import ProfilerActivity, profile

            _silence_stderr(stack)
            holder: list = []
            stack.callback(lambda: ops.update(e.name for e in holder[0].events()))  # after exit
            holder.append(stack.enter_context(profile(activities=[ProfilerActivity.CPU])))
        if options.get("measure_memory"):
            import tracemalloc

            from torch.profiler import ProfilerActivity, profile

            _silence_stderr(stack)
            profiler = stack.enter_context(
                profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            )
            tracemalloc.start()
            stack.callback(tracemalloc.stop)
        try:
            result = call_learner(fn, args, kwargs, grid, tuple(options.get("blocked", ())))
        except CheckTimeout:
            raise  # check()'s deadline: the notebook's cell stops here
        except BaseException as exc:  # noqa: BLE001 - report anything, SystemExit included
            text = _safe_str(exc)
            return ("raised", type(exc).__name__, text[:MESSAGE_CHARS]), info
        if options.get("measure_memory"):
            import tracemalloc

            info["python_peak_bytes"] = tracemalloc.get_traced_memory()[1]
    if profiler is not None:
        info["torch_peak_bytes"] = _torch_peak_bytes(profiler.events())
    if options.get("torch_ops"):
        info["torch_ops"] = sorted(ops)
    info["aliases"] = _aliases(result, args)
    return ("returned", result), info


def _safe_str(exc) -> str:
    try:
        return str(exc)
    except BaseException:  # noqa: BLE001
        return f"<{type(exc).__name__}>"


def _is_triton_kernel(value) -> bool:
    """A @triton.jit kernel: a JITFunction, or the InterpretedFunction that @triton.jit makes of
    one under TRITON_INTERPRET=1 (wrapping a plain Python function)."""
    jit = sys.modules.get("triton.runtime.jit")
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if jit is not None and isinstance(value, jit.JITFunction):
        return True
    return (
        interpreter is not None
        and isinstance(value, interpreter.InterpretedFunction)
        and isinstance(getattr(value, "fn", None), types.FunctionType)
    )


def _describe(namespace: dict, name: str) -> dict:
    value = namespace.get(name)
    if value is None:
        return {"kind": "missing"}
    is_jit = _is_triton_kernel(value)
    if not callable(value) and not is_jit:
        return {"kind": "not callable", "type": type(value).__name__}
    source = ""
    with contextlib.suppress(Exception):
        import inspect

        source = inspect.getsource(getattr(value, "fn", value))
    return {
        "kind": "callable",
        "type": type(value).__name__,
        "jit": is_jit,
        "source_sha": hashlib.sha256(source.encode()).hexdigest() if source else "",
    }


def handle_request(request, namespace: dict):
    """One request of the grader -> its reply (plain data)."""
    kind = request[0]
    if kind == "describe":
        return ("described", _describe(namespace, request[1]))
    if kind == "guard":
        _, names, question_id = request
        return ("guarded", install_guards(tuple(names), question_id))
    if kind == "status":
        import threading

        return ("status", {"threads": threading.active_count()})
    if kind == "call":
        _, name, args, kwargs, options = request
        fn = namespace.get(name)
        outcome, info = _run_call(fn, args, kwargs, options)
        if outcome[0] == "raised":
            return ("raised", outcome[1], outcome[2], encode(info))
        memo: dict = {}
        try:
            encoded = encode(outcome[1], memo)
            args_after = encode(list(args), memo) if options.get("return_args", True) else None
        except CheckTimeout:
            raise
        except BaseException as exc:  # noqa: BLE001
            return (
                "raised",
                type(exc).__name__,
                f"its result could not be read: {_safe_str(exc)}",
                encode(info),
            )
        return ("returned", encoded, args_after, encode(info))
    return ("error", f"unknown request {kind!r}")


def serve(channel: Channel, namespace: dict, *, until: str = "end"):
    """Answer requests until one of kind `until` arrives; returns that request."""
    while True:
        request = channel.recv()
        if request[0] == until:
            return request
        channel.send(handle_request(request, namespace))


# --- the child process: load a notebook, then serve ---------------------------------------------


def _cell_code(source: str):
    """A cell's source as Python: line magics and shell escapes become `pass`; `%%time`,
    `%%capture` and `%%prun` run their body; other cell magics are refused."""
    stripped = source.lstrip()
    if stripped.startswith("%%"):
        first, _, body = stripped.partition("\n")
        magic = first[2:].split()[0] if first[2:].split() else ""
        if magic in ("time", "capture", "prun"):
            source = "\n" + body  # keep line numbers
        else:
            raise SyntaxError(f"the cell magic %%{magic} is not run by the grader")
    lines = []
    for line in source.splitlines():
        s = line.lstrip()
        lines.append(line[: len(line) - len(s)] + "pass" if s.startswith(("%", "!")) else line)
    return "\n".join(lines)


def _load(channel: Channel, namespace: dict, cells: list[str], skip: set[int]) -> None:
    for index, source in enumerate(cells):
        if index in skip:
            continue
        filename = f"<cell {index}>"
        error = None
        try:
            text = _cell_code(source)
            linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
            exec(compile(text, filename, "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001 - learner code may raise SystemExit too
            error = f"cell {index}: {type(exc).__name__}: {_safe_str(exc)}"[:MESSAGE_CHARS]
        channel.send(("cell", index, error))


def child_main(read_fd: int, write_fd: int) -> None:
    """The grader's child: silence stdout/stderr at the descriptor level, then serve."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    channel = Channel(read_fd, write_fd, trusted=True)
    os.environ["KVLIB_GRADING"] = "1"
    namespace: dict = {"__name__": "__main__"}
    request = channel.recv()
    if request[0] == "guard":  # every question's blocked names, before the notebook runs
        channel.send(handle_request(request, namespace))
        request = channel.recv()
    if request[0] == "load":
        _, cells, skip = request
        _load(channel, namespace, cells, set(skip))
        channel.send(("loaded",))
    serve(channel, namespace)
    os._exit(0)


if __name__ == "__main__":
    child_main(int(sys.argv[1]), int(sys.argv[2]))
