"""Default-deny while a graded call runs: kvlib is unavailable to the learner's code, except the
helpers its question allows, and no process may be created.

**kvlib.** While a graded call runs (`call_learner`, or a thread it started), a function of
kvlib's library or of the check modules called by anything but kvlib library code raises
GradingError, unless the question allows it (`@question(allowed=...)`). Every function of every
imported kvlib module (and of each imported later: an import hook) is recompiled from its source
with a first statement that calls the guard, held as a constant of the code.

A **copy** of kvlib's code (its source compiled again) is not matched: where the OS allows it
the mount namespace (`kvlib.course.isolation`) hides kvlib's files from the learner's process, and
copying code is for an instructor reading the notebook to judge, not the grader.

**Processes.** The same audit hook refuses to create processes (`subprocess`, `os.system`,
`os.fork`, `os.exec*`, `os.posix_spawn`, `os.spawn*`, `_posixsubprocess.fork_exec`), to signal
another process, and `ctypes` (but loading a library that lies in site-packages, as torch does on
import): in the grader's child always, from before the notebook loads (`forbid_processes`), and
elsewhere while a graded call runs, in the process that runs it and in any process forked from it
earlier (a pool made while a notebook ran). Threads are allowed. In the grader's child on Linux a
seccomp filter refuses the same in the kernel (`kvlib.course.confine`).

All of this runs in the learner's own process, which can rewrite it: a best effort (see
book/grader_guarantees.md for what the OS enforces where).
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import mmap
import os
import sys
import types
import warnings
from pathlib import Path

from kvlib.course import confine

_KVLIB_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_COURSE_DIR = str(Path(__file__).resolve().parent) + os.sep
_CHECKS_DIR = str(Path(__file__).resolve().parent / "checks") + os.sep
_CHECKS_PREFIX = "kvlib.course.checks"
# kvlib.ops.interpreter computes nothing a question asks; on Triton < 3.7 its patch of Triton's
# interpreter (patch_scalar_index) runs inside every interpreted launch of the learner's kernel
_INTERPRETER_FILE = str(Path(__file__).resolve().parents[1] / "ops" / "interpreter.py")
_PLACEHOLDER = "__kvlib_course_guard_placeholder__"


class GradingError(RuntimeError):
    """What a graded call may not do: call a kvlib function not allowed, create a process."""


_ACTIVE = [0]  # graded calls running in this process
# 1 while a graded call runs in the process that imported this module: a process forked from it
# earlier shares the page and obeys the same rules meanwhile
_SHARED = mmap.mmap(-1, 1)
_ORIGIN = os.getpid()
_state: dict = {"question": "", "allowed": (), "always": False, "installed": False}
_ORIGINAL: dict[int, tuple[types.FunctionType, types.CodeType]] = {}  # id(fn) -> (fn, its code)


def graded_call_running() -> bool:
    """Whether a graded call runs now, in this process or (for a fork) in its parent."""
    return bool(_ACTIVE[0]) or (_SHARED[0] == 1 and os.getpid() != _ORIGIN)


def call_learner(fn, args, kwargs, grid):
    """Run the learner's `fn` as a graded call (a Triton kernel launched on `grid`)."""
    _ACTIVE[0] += 1
    _SHARED[0] = 1
    try:
        if grid is not None:
            return fn[grid](*args, **kwargs)
        return fn(*args, **kwargs)
    finally:
        _ACTIVE[0] -= 1
        if not _ACTIVE[0]:
            _SHARED[0] = 0


def _allowed(dotted: str) -> bool:
    if os.getpid() != _ORIGIN:
        return False  # a fork: nothing is allowed
    return any(dotted == name or dotted.startswith(name + ".") for name in _state["allowed"])


def _guard(dotted: str) -> None:
    """The first statement of every guarded function."""
    if not _state["installed"] or not graded_call_running():
        return
    try:
        caller = sys._getframe(2).f_code  # 0: here, 1: the guarded function, 2: its caller
    except ValueError:
        caller = None
    if caller is not None and _LIBRARY.get(id(caller)) is caller:
        return
    if dotted.startswith(_CHECKS_PREFIX + "."):
        raise GradingError(
            f"{dotted} is the grader's own check code, unavailable to your answer: write it "
            "yourself"
        )
    if not _allowed(dotted):
        raise GradingError(_unavailable(dotted))


def _unavailable(dotted: str) -> str:
    allowed = ", ".join(_state["allowed"]) if os.getpid() == _ORIGIN else ""
    graded = f"question {_state['question']!r}" if _state["question"] else "your code"
    return (
        f"{dotted} is unavailable while {graded} is graded: write it yourself (kvlib functions "
        f"this question allows: {allowed or 'none'})"
    )


# --- recompiling kvlib with the guard -------------------------------------------------------------

_LIBRARY: dict[int, types.CodeType] = {}  # id -> code of kvlib's library: callers let through
_GUARDED: dict[str, dict] = {}  # file -> {(qualname, first line): guarded code}
_GUARDED_IDS: set[int] = set()


def _module_name(filename: str) -> str | None:
    """kvlib's module defined in `filename`, if it is kvlib library or check code."""
    if not filename.startswith(_KVLIB_DIR) or not filename.endswith(".py"):
        return None
    if filename.startswith(_COURSE_DIR) and not filename.startswith(_CHECKS_DIR):
        return None  # the course machinery (grading, notebook helpers) is not guarded
    if filename == _INTERPRETER_FILE:
        return None  # Triton's interpreter set-up, which a graded kernel's launch runs through
    parts = list(Path(filename[len(_KVLIB_DIR) :]).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvlib", *parts])


class _Prologues(ast.NodeVisitor):
    """Puts `_PLACEHOLDER("module.qualname")` first in every function (after its docstring)."""

    def __init__(self, module: str):
        self.module, self.stack = module, []

    def visit_ClassDef(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def visit_FunctionDef(self, node):
        module_hook = not self.stack and node.name in ("__getattr__", "__dir__")
        if not module_hook:  # a module's lazy attribute lookup computes nothing
            dotted = ".".join([self.module, *self.stack, node.name])
            first = node.body[0]
            call = ast.Expr(
                ast.Call(ast.Constant(_PLACEHOLDER), [ast.Constant(dotted)], keywords=[])
            )
            for part in ast.walk(call):
                part.lineno = part.end_lineno = first.lineno
                part.col_offset = part.end_col_offset = 0
            docstring = isinstance(first, ast.Expr) and isinstance(
                getattr(first, "value", None), ast.Constant
            )
            node.body.insert(1 if docstring and isinstance(first.value.value, str) else 0, call)
        self.stack += [node.name, "<locals>"]
        self.generic_visit(node)
        del self.stack[-2:]

    visit_AsyncFunctionDef = visit_FunctionDef


def _bind(code: types.CodeType) -> types.CodeType:
    """`code` with the placeholder constant replaced by the guard, nested code included."""
    consts = tuple(
        _guard
        if isinstance(c, str) and c == _PLACEHOLDER
        else _bind(c)
        if isinstance(c, types.CodeType)
        else c
        for c in code.co_consts
    )
    return code.replace(co_consts=consts)


def _walk(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _walk(const)


def _guarded_codes(filename: str) -> dict:
    """{(qualname, first line): guarded code} for kvlib's file `filename`, compiled once."""
    if filename in _GUARDED:
        return _GUARDED[filename]
    module = _module_name(filename)
    table: dict = {}
    _GUARDED[filename] = table
    if module is None:
        return table
    try:
        source = Path(filename).read_text(encoding="utf-8")
        tree = ast.parse(source, filename)
        _Prologues(module).visit(tree)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "'str' object is not callable": the placeholder
            guarded = _bind(compile(tree, filename, "exec", dont_inherit=True))
    except (OSError, SyntaxError, ValueError):
        return table
    library = not module.startswith(_CHECKS_PREFIX)
    for code in _walk(guarded):
        if library:
            _LIBRARY[id(code)] = code
        if any(c is _guard for c in code.co_consts):
            table[(code.co_qualname, code.co_firstlineno)] = code
            _GUARDED_IDS.add(id(code))
    return table


def _guard_function(fn: types.FunctionType) -> None:
    """Give kvlib's function `fn` its guarded code (found by file, name and first line)."""
    code = fn.__code__
    if id(code) in _GUARDED_IDS or _module_name(code.co_filename) is None:
        return  # guarded already, or not kvlib's library or check code
    guarded = _guarded_codes(code.co_filename).get((code.co_qualname, code.co_firstlineno))
    if guarded is not None and guarded.co_freevars == code.co_freevars:
        _ORIGINAL.setdefault(id(fn), (fn, code))
        fn.__code__ = guarded


def install_guards(allowed: tuple[str, ...], question_id: str) -> None:
    """Guard every kvlib function in this process; while question `question_id` is graded, the
    learner's code may call the kvlib functions `allowed` (dotted names; a class allows its
    methods) and no other."""
    import gc

    _state.update(question=question_id, allowed=tuple(allowed), installed=True)
    _install_import_hook()
    _install_audit_hook()
    for obj in gc.get_objects():
        if type(obj) is types.FunctionType:
            _guard_function(obj)


def remove_guards() -> None:
    """Undo `install_guards` here (original code back, no import hook, the audit hook idle), for
    a process that ran check() and goes on with other work (a test runner)."""
    for fn, code in _ORIGINAL.values():
        if id(fn.__code__) in _GUARDED_IDS:
            fn.__code__ = code
    _ORIGINAL.clear()
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _GuardingFinder)]
    _state.update(question="", allowed=(), installed=False)


class _GuardingFinder(importlib.abc.MetaPathFinder):
    """Guards a kvlib module imported (again) after `install_guards`, before any call."""

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
                filename = getattr(module, "__file__", None) or ""
                if _module_name(filename) is None or not hasattr(loader, "get_code"):
                    loader.exec_module(module)
                    return
                code = loader.get_code(module.__name__)
                for part in _walk(code):  # the module's own body calls into kvlib
                    _LIBRARY[id(part)] = part
                _guarded_codes(filename)
                exec(code, module.__dict__)
                for value in list(vars(module).values()):
                    for fn in _functions_of(value):
                        _guard_function(fn)

            def __getattr__(self, name):
                return getattr(loader, name)

        spec.loader = Loader()
        return spec


def _functions_of(value) -> list:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, type):
        return [f for attr in vars(value).values() for f in _functions_of(attr)]
    return []


def _install_import_hook() -> None:
    if not any(isinstance(f, _GuardingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardingFinder())


# --- the audit hook: a guarded function's code, processes ----------------------------------------

_EVENTS = {"object.__setattr__"} | confine.PROCESS_EVENTS | confine.CTYPES_EVENTS


def _audit(event: str, args: tuple) -> None:
    if event not in _EVENTS:
        return
    if event != "object.__setattr__":
        rules_apply = _state["always"] or _state["installed"] and graded_call_running()
        if confine.process_refused(event, args, rules_apply):
            raise GradingError(
                f"{event} is not allowed while your code is graded: it runs without creating "
                "processes or using ctypes (threads are fine)"
            )
        return
    if not (_state["installed"] and graded_call_running()) or len(args) < 3:
        return
    if args[1] == "__code__" and type(args[0]) is types.FunctionType:
        if id(args[0].__code__) in _GUARDED_IDS:
            raise GradingError("a guarded kvlib function's code cannot be replaced while graded")


def _install_audit_hook() -> None:
    if not _state.get("audit_hook"):
        sys.addaudithook(_audit)  # for the life of the process: an audit hook cannot be removed
        _state["audit_hook"] = True
        confine.wrap_fork_exec(
            lambda: _state["always"] or _state["installed"] and graded_call_running(),
            lambda message: GradingError(message),
        )


def forbid_processes() -> None:
    """From now on, for the life of this process (the grader's child), refuse what the audit
    hook refuses while a graded call runs: processes, signals to others, ctypes."""
    _state["always"] = True
    _install_audit_hook()
