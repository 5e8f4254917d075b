"""The learner's side of grading: a process that holds the learner's code, receives a test's inputs
and returns the outputs by value. The grader (`kvlib.course.grading`) keeps the tests, the
expected values and the verdict in its own process, which the learner's code cannot reach.

The protocol (`Channel`): length-prefixed frames over two pipes. The grader sends pickled requests
(inputs are data it made itself); the learner's side answers with *encoded* values
(`encode`/`decode`: tensors, arrays, numbers, strings and containers, rebuilt by the grader without
running any code from the learner's side: its unpickler refuses every global).

Two servers speak it, with the same `handle_request`:
- the grader's child process (`python -m kvlib.course.sandbox RFD WFD`), which first executes a
  notebook's code cells one by one, reporting each cell as it finishes (so a cell that ends the
  process or hangs costs only itself: the grader restarts the child without it);
- the notebook itself, while `check()` waits for the grader subprocess it started.

Blocking by provenance (`install_guards`): the kvlib functions a question replaces are recompiled in
place with a first statement that asks who called them. A call whose caller's code object is not
kvlib library code (kvlib outside kvlib/course), made while a graded call runs, raises
GradingError: every alias, re-export, default argument and reloaded copy of the function is the
same function object or gets the same guard, and no unguarded original is kept anywhere.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import io
import linecache
import os
import pickle
import select
import struct
import sys
import types
from pathlib import Path

MESSAGE_CHARS = 400
MAX_FRAME_BYTES = 512 * 2**20  # a reply larger than this is refused
_KVLIB_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_COURSE_DIR = str(Path(__file__).resolve().parent) + os.sep
_CHECKS_PREFIX = "kvlib.course.checks"


class GradingError(RuntimeError):
    """Raised by a kvlib function that is unavailable while the question replacing it is graded."""


class ChannelClosed(Exception):
    """The other side ended (its process exited or closed the pipe)."""


class ChannelTimeout(Exception):
    """Nothing arrived in time."""


# --- transport ------------------------------------------------------------------------------------


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


class Channel:
    """Frames over a pair of file descriptors. `trusted`: unpickle with every global allowed (only
    where the sender is the grader); otherwise no global at all (the reply is encoded data)."""

    def __init__(self, read_fd: int, write_fd: int, *, trusted: bool):
        self.read_fd, self.write_fd, self.trusted = read_fd, write_fd, trusted

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=4)
        payload = struct.pack("<Q", len(data)) + data
        view = memoryview(payload)
        while view:
            try:
                written = os.write(self.write_fd, view)
            except (BrokenPipeError, OSError) as exc:
                raise ChannelClosed(str(exc)) from None
            view = view[written:]

    def _read(self, size: int, deadline: float | None) -> bytes:
        import time

        chunks, left = [], size
        while left:
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0 or not select.select([self.read_fd], [], [], wait)[0]:
                    raise ChannelTimeout()
            try:
                chunk = os.read(self.read_fd, min(left, 1 << 20))
            except OSError as exc:
                raise ChannelClosed(str(exc)) from None
            if not chunk:
                raise ChannelClosed("end of stream")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def recv(self, timeout_s: float | None = None):
        import time

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        (size,) = struct.unpack("<Q", self._read(8, deadline))
        if size > MAX_FRAME_BYTES:
            raise ChannelClosed(f"a reply of {size:,} bytes is larger than the grader accepts")
        data = self._read(size, deadline)
        if self.trusted:
            return pickle.loads(data)
        return _NoGlobals(io.BytesIO(data)).load()


# --- values by value ------------------------------------------------------------------------------


def encode(value, memo: dict | None = None, depth: int = 0):
    """`value` as nested tuples of plain data (see the module docstring); objects seen twice
    become references, so identity within one reply survives."""
    import numpy as np

    memo = {} if memo is None else memo
    if depth > 60:
        return ("X", "a structure nested more than 60 levels deep")
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        if type(value) in (bool, int, float, complex, str, bytes, type(None)):
            return ("P", value)
    key = id(value)
    if key in memo:
        return ("R", memo[key][0])
    memo[key] = (len(memo), value)  # keep value alive so ids stay unique
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                return ("O", type(value).__name__, "a torch.Tensor subclass", ())
            t = value.detach()
            if t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized:
                t = t.to_dense() if t.layout != torch.strided else t
                t = t.cpu()
            flat = t.contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return ("T", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return ("O", "ndarray", "a numpy array of Python objects", ())
        return ("A", value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, np.generic):
        return ("S", value.dtype.str, value.tobytes())
    if type(value) is list:
        return ("L", tuple(encode(v, memo, depth + 1) for v in value))
    if type(value) is tuple:
        return ("U", tuple(encode(v, memo, depth + 1) for v in value))
    if type(value) is dict:
        return (
            "D",
            tuple(
                (encode(k, memo, depth + 1), encode(v, memo, depth + 1)) for k, v in value.items()
            ),
        )
    if type(value) in (set, frozenset):
        kind = "E" if type(value) is set else "F"
        return (kind, tuple(encode(v, memo, depth + 1) for v in value))
    attrs = ()
    with contextlib.suppress(Exception):
        fields = getattr(value, "__dict__", None)
        if isinstance(fields, dict):
            attrs = tuple(
                (str(k), encode(v, memo, depth + 1))
                for k, v in list(fields.items())[:50]
                if isinstance(k, str)
            )
    return ("O", type(value).__name__, _safe_repr(value), attrs)


def _safe_repr(value) -> str:
    try:
        return repr(value)[:200]
    except BaseException:  # noqa: BLE001 - a learner's __repr__ may raise anything
        return f"<{type(value).__name__}>"


class Opaque:
    """A value the grader cannot rebuild (an object of the learner's own class, ...): its type name,
    repr and attributes (decoded), for messages and attribute checks."""

    def __init__(self, type_name: str, text: str):
        self._type_name, self._text = type_name, text

    def __repr__(self) -> str:
        return self._text


_OPAQUE_TYPES: dict[str, type] = {}


def decode(node, refs: list | None = None):
    """The value `encode` described, rebuilt from plain data."""
    import numpy as np
    import torch

    refs = [] if refs is None else refs
    if not isinstance(node, tuple) or not node or not isinstance(node[0], str):
        raise ValueError("malformed reply")
    kind = node[0]
    if kind == "P":
        return node[1]
    if kind == "R":
        return refs[node[1]]
    slot = len(refs)
    refs.append(None)
    if kind == "T":
        _, dtype, shape, raw = node
        torch_dtype = getattr(torch, dtype)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
        if flat is None:
            value = torch.empty(shape, dtype=torch_dtype)
        else:
            value = flat.view(torch_dtype).reshape(shape).clone()
    elif kind == "A":
        _, dtype, shape, raw = node
        value = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    elif kind == "S":
        value = np.frombuffer(node[2], dtype=np.dtype(node[1]))[0]
    elif kind == "L":
        value = []
        refs[slot] = value
        value.extend(decode(v, refs) for v in node[1])
    elif kind == "U":
        value = tuple(decode(v, refs) for v in node[1])
    elif kind == "D":
        value = {}
        refs[slot] = value
        for k, v in node[1]:
            value[decode(k, refs)] = decode(v, refs)
    elif kind in ("E", "F"):
        items = [decode(v, refs) for v in node[1]]
        value = set(items) if kind == "E" else frozenset(items)
    elif kind == "O":
        _, type_name, text, attrs = node
        cls = _OPAQUE_TYPES.setdefault(type_name, type(str(type_name), (Opaque,), {}))
        value = cls(type_name, text)
        refs[slot] = value
        for name, v in attrs:
            with contextlib.suppress(Exception):
                setattr(value, name, decode(v, refs))
    elif kind == "X":
        raise ValueError(node[1])
    else:
        raise ValueError(f"malformed reply node {kind!r}")
    refs[slot] = value
    return value


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


# --- blocking by provenance -----------------------------------------------------------------------

_state: dict = {"question": "", "guarded": {}, "library_codes": {}}


def _walk_codes(code, into: dict) -> None:
    into[id(code)] = code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _walk_codes(const, into)


def _register_library(module) -> None:
    """Remember the code objects of a kvlib library module: the only callers a guard lets
    through (a learner's code compiled under a library file name is not among them)."""
    name = getattr(module, "__name__", "") or ""
    if not name.startswith("kvlib") or name.startswith("kvlib.course"):
        return
    codes = _state["library_codes"]
    for value in list(vars(module).values()):
        for fn in _functions_of(value):
            if getattr(fn, "__module__", None) == name:
                _walk_codes(fn.__code__, codes)


def _resolve(dotted: str):
    """The object a dotted name denotes: a module attribute, or a class's attribute (raw, so a
    property or staticmethod comes back as such)."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        value = sys.modules.get(".".join(parts[:split]))
        if value is None:
            continue  # not imported (yet): the import hook guards it when it is
        for name in parts[split:]:
            value = vars(value)[name] if isinstance(value, type) else getattr(value, name)
        return value
    raise ImportError(dotted)


def _functions_of(value) -> list:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [
            f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType)
        ]
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, type):
        found = []
        for attr in vars(value).values():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if isinstance(attr, property):
                found.extend(f for f in (attr.fget, attr.fset, attr.fdel) if f is not None)
            elif isinstance(attr, types.FunctionType):
                found.append(attr)
        return found
    return []


def _make_guard():
    def blocked_now():
        """The names blocked by the graded call running now (a local of its frame), or None
        outside a graded call."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is dispatch:
                return frame.f_locals.get("blocked", ())
            frame = frame.f_back
        return None

    def guard(name: str) -> None:
        caller = sys._getframe(2).f_code  # 0: here, 1: the guarded function, 2: its caller
        if library.get(id(caller)) is caller:
            return
        blocked = blocked_now()
        if blocked is not None and name.startswith(_CHECKS_PREFIX + "."):
            raise GradingError(
                f"{name} is the grader's own check code, unavailable to your answer: write it "
                "yourself"
            )
        if blocked is not None and name in blocked:
            raise GradingError(
                f"{name} is unavailable while question {_state['question']!r} is graded: write "
                "it yourself"
            )

    library = _state["library_codes"]
    dispatch = _call_learner.__code__
    return guard


_GUARD_NAME = "__kvlib_course_guard__"


def _guard_function(fn, dotted: str) -> bool:
    """Recompile `fn` in place with the guard as its first statement. False if impossible."""
    code = fn.__code__
    if _GUARD_NAME in code.co_names:
        return True  # already guarded
    filename = code.co_filename
    cache_key = (filename, code.co_qualname, code.co_firstlineno, dotted)
    cached = _GUARDED_CODES.get(cache_key)
    if cached is not None and cached.co_freevars == code.co_freevars:
        fn.__globals__[_GUARD_NAME] = _GUARD
        fn.__code__ = cached
        return True
    try:
        source = Path(filename).read_text()
    except OSError:
        return False
    tree = ast.parse(source, filename)
    target = None
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name == code.co_name
            and min([node.lineno] + [d.lineno for d in node.decorator_list]) == code.co_firstlineno
        ):
            target = node
            break
    if target is None:
        return False
    call = ast.parse(f"{_GUARD_NAME}({dotted!r})").body[0]
    for n in ast.walk(call):
        n.lineno, n.col_offset = target.body[0].lineno, 0
        n.end_lineno, n.end_col_offset = target.body[0].lineno, 0
    docstring = (
        1
        if isinstance(target.body[0], ast.Expr)
        and isinstance(getattr(target.body[0], "value", None), ast.Constant)
        and isinstance(target.body[0].value.value, str)
        else 0
    )
    target.body.insert(docstring, call)
    compiled = compile(tree, filename, "exec", dont_inherit=True)
    found: dict = {}
    _walk_codes(compiled, found)
    for candidate in found.values():
        if (
            candidate.co_name == code.co_name
            and candidate.co_firstlineno == code.co_firstlineno
            and _GUARD_NAME in candidate.co_names
            and candidate.co_freevars == code.co_freevars
        ):
            fn.__globals__[_GUARD_NAME] = _GUARD
            if filename.startswith(_KVLIB_DIR) and not filename.startswith(_COURSE_DIR):
                _walk_codes(candidate, _state["library_codes"])  # still library code
            fn.__code__ = candidate
            _GUARDED_CODES[cache_key] = candidate
            return True
    return False


_GUARDED_CODES: dict = {}


def install_guards(names: tuple[str, ...], question_id: str) -> list[str]:
    """Guard the kvlib functions `names` (dotted; a class guards all its methods) and every function
    of the check modules; returns the names that could not be guarded."""
    _state["question"] = question_id
    _install_import_hook()
    for module in list(sys.modules.values()):
        _register_library(module)
    failed = []
    targets = list(names)
    for module_name in [m for m in list(sys.modules) if m.startswith(_CHECKS_PREFIX + ".")]:
        targets.extend(
            f"{module_name}.{k}"
            for k, v in vars(sys.modules[module_name]).items()
            if isinstance(v, types.FunctionType) and v.__module__ == module_name
        )
    identities: dict = {}
    for dotted in targets:
        _state["guarded"][dotted] = True
        try:
            value = _resolve(dotted)
        except ImportError:
            continue  # its module is not imported: guarded on import
        except (AttributeError, KeyError):
            failed.append(dotted)
            continue
        for fn in _functions_of(value):
            identities[(fn.__code__.co_filename, fn.__code__.co_qualname)] = dotted
            if not _guard_function(fn, dotted):
                failed.append(dotted)
    # copies: the same function from a module object since replaced in sys.modules, or a
    # FunctionType built on its code before the guard was installed
    import gc

    for obj in gc.get_objects():
        if type(obj) is types.FunctionType:
            code = obj.__code__
            dotted = identities.get((code.co_filename, code.co_qualname))
            if dotted is not None and _GUARD_NAME not in code.co_names:
                _guard_function(obj, dotted)
    return failed


class _GuardingFinder(importlib.abc.MetaPathFinder):
    """Re-guards a kvlib module that is imported again or reloaded: its fresh functions get the
    guard before anyone can call them."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("kvlib"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                _register_library(module)
                prefix = module.__name__ + "."
                for dotted in list(_state["guarded"]):
                    if dotted.startswith(prefix):
                        with contextlib.suppress(Exception):
                            value = module
                            for name in dotted[len(prefix) :].split("."):
                                value = (
                                    vars(value)[name]
                                    if isinstance(value, type)
                                    else getattr(value, name)
                                )
                            for fn in _functions_of(value):
                                _guard_function(fn, dotted)
                if module.__name__.startswith(_CHECKS_PREFIX + "."):
                    for k, v in list(vars(module).items()):
                        if isinstance(v, types.FunctionType) and v.__module__ == module.__name__:
                            _state["guarded"][f"{module.__name__}.{k}"] = True
                            _guard_function(v, f"{module.__name__}.{k}")

            def __getattr__(self, name):
                return getattr(loader, name)

        spec.loader = Loader()
        return spec


def _install_import_hook() -> None:
    if not any(isinstance(f, _GuardingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardingFinder())


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


def _call_learner(fn, args, kwargs, grid, blocked):
    """The one frame that marks a graded call: the guards look for it on the stack and read
    `blocked` from it."""
    if grid is not None:
        return fn[grid](*args, **kwargs)
    return fn(*args, **kwargs)


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
            result = _call_learner(fn, args, kwargs, grid, tuple(options.get("blocked", ())))
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


_GUARD = _make_guard()

if __name__ == "__main__":
    child_main(int(sys.argv[1]), int(sys.argv[2]))
