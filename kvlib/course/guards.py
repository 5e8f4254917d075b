"""Default-deny while a graded call runs (`call_learner`, or a thread it started), in the
learner's own process: a best effort (book/grader_guarantees.md). Every function of every kvlib
module, imported now or later (an import hook), is recompiled with a first statement that calls
the guard: called by anything but kvlib library code, a kvlib library or check function raises
GradingError unless the question allows it (`@question(allowed=...)`). An audit hook refuses
processes (not threads), signals to another process and `ctypes` (but loading a library in
site-packages, as torch does): in the grader's child always (`forbid_processes`), elsewhere while
a graded call runs, here and in a process forked from here earlier (a pool made in a notebook).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import importlib.abc
import importlib.machinery
import mmap
import os
import site
import sys
import sysconfig
import types
import warnings
from pathlib import Path

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
        return (fn if grid is None else fn[grid])(*args, **kwargs)
    finally:
        _ACTIVE[0] -= 1
        _SHARED[0] = min(_ACTIVE[0], 1)


def _guard(dotted: str) -> None:
    """The first statement of every guarded function."""
    if not _state["installed"] or not graded_call_running():
        return
    caller = sys._getframe(1).f_back  # the guarded function's caller (None: called from C)
    if caller is not None and _LIBRARY.get(id(caller.f_code)) is caller.f_code:
        return
    if dotted.startswith(_CHECKS_PREFIX + "."):
        raise GradingError(
            f"{dotted} is the grader's own check code, unavailable to your answer: write it "
            "yourself"
        )
    allowed = _state["allowed"] if os.getpid() == _ORIGIN else ()  # a fork: nothing is allowed
    if any(dotted == name or dotted.startswith(name + ".") for name in allowed):
        return
    graded = f"question {_state['question']!r}" if _state["question"] else "your code"
    raise GradingError(
        f"{dotted} is unavailable while {graded} is graded: write it yourself (kvlib functions "
        f"this question allows: {', '.join(allowed) or 'none'})"
    )


# --- recompiling kvlib with the guard -------------------------------------------------------------

_LIBRARY: dict[int, types.CodeType] = {}  # id -> code of kvlib's library: callers let through
_GUARDED_IDS: set[int] = set()


def _module_name(filename: str) -> str | None:
    """kvlib's module defined in `filename`, if it is kvlib library or check code."""
    if not filename.startswith(_KVLIB_DIR) or not filename.endswith(".py"):
        return None
    if filename.startswith(_COURSE_DIR) and not filename.startswith(_CHECKS_DIR):
        return None  # the course machinery (grading, notebook helpers) is not guarded
    if filename == _INTERPRETER_FILE:
        return None  # Triton's interpreter set-up, which a graded kernel's launch runs through
    parts = Path(filename[len(_KVLIB_DIR) :]).with_suffix("").parts
    return ".".join(["kvlib", *parts]).removesuffix(".__init__")


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
            call = ast.parse(f"{_PLACEHOLDER!r}({dotted!r})").body[0]
            ast.increment_lineno(call, first.lineno - 1)  # on the line of the body's first
            docstring = ast.get_docstring(node, clean=False) is not None
            node.body.insert(1 if docstring else 0, call)
        self.stack += [node.name, "<locals>"]
        self.generic_visit(node)
        del self.stack[-2:]

    visit_AsyncFunctionDef = visit_FunctionDef


def _bind(const):
    """A code object's constant with the placeholder replaced by the guard, nested code included."""
    if isinstance(const, types.CodeType):
        return const.replace(co_consts=tuple(map(_bind, const.co_consts)))
    return _guard if isinstance(const, str) and const == _PLACEHOLDER else const


@functools.cache
def _guarded_codes(filename: str) -> tuple[types.CodeType | None, dict]:
    """(the guarded module code, {(qualname, first line): guarded code}) for kvlib's file
    `filename`, compiled once; (None, {}) where it is not kvlib's or does not compile."""
    module = _module_name(filename)
    if module is None:
        return None, {}
    try:
        source = Path(filename).read_text(encoding="utf-8")
        tree = ast.parse(source, filename)
        _Prologues(module).visit(tree)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "'str' object is not callable": the placeholder
            guarded = _bind(compile(tree, filename, "exec", dont_inherit=True))
    except (OSError, SyntaxError, ValueError):
        return None, {}
    table, library, codes = {}, not module.startswith(_CHECKS_PREFIX), [guarded]
    for code in codes:  # the module's code and, as the loop reaches them, all nested in it
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        if library:
            _LIBRARY[id(code)] = code
        if any(c is _guard for c in code.co_consts):
            table[(code.co_qualname, code.co_firstlineno)] = code
            _GUARDED_IDS.add(id(code))
    return guarded, table


def install_guards(allowed: tuple[str, ...], question_id: str) -> None:
    """Guard every kvlib function in this process; while question `question_id` is graded, the
    learner's code may call the kvlib functions `allowed` (dotted names; a class allows its
    methods) and no other."""
    _state.update(question=question_id, allowed=tuple(allowed), installed=True)
    if not any(isinstance(f, _GuardingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardingFinder())
    _install_audit_hook()
    for fn in gc.get_objects():  # kvlib's library and check functions get their guarded code
        code = fn.__code__ if type(fn) is types.FunctionType else None
        if code is None or id(code) in _GUARDED_IDS or _module_name(code.co_filename) is None:
            continue  # not a function, guarded already, or not kvlib's
        guarded = _guarded_codes(code.co_filename)[1].get((code.co_qualname, code.co_firstlineno))
        if guarded is not None and guarded.co_freevars == code.co_freevars:
            _ORIGINAL.setdefault(id(fn), (fn, code))
            fn.__code__ = guarded


def remove_guards() -> None:
    """Undo `install_guards` here (original code back, no import hook, the audit hook idle), for
    a process that ran check() and goes on with other work (a test runner)."""
    for fn, code in _ORIGINAL.values():
        if id(fn.__code__) in _GUARDED_IDS:
            fn.__code__ = code
    _ORIGINAL.clear()
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _GuardingFinder)]
    _state.update(question="", allowed=(), installed=False)


class _GuardingLoader(importlib.machinery.SourceFileLoader):
    """Runs a kvlib module imported (again) after `install_guards` as its guarded code."""

    def exec_module(self, module):
        code = _guarded_codes(self.path)[0]
        if code is None:
            return super().exec_module(module)
        _LIBRARY[id(code)] = code  # the module's own body calls into kvlib
        exec(code, module.__dict__)


class _GuardingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("kvlib"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if isinstance(loader, importlib.machinery.SourceFileLoader) and _module_name(loader.path):
            spec.loader = _GuardingLoader(loader.name, loader.path)
        return spec


# --- the audit hook: a guarded function's code, processes ----------------------------------------

_REFUSED = frozenset(
    {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
     "os.startfile", "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg",
     "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function",
     "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.addressof", "ctypes.string_at",
     "ctypes.wstring_at", "ctypes.create_string_buffer", "ctypes.create_unicode_buffer",
     "ctypes.get_errno", "ctypes.set_errno", "ctypes.PyObj_FromPtr"}
)  # fmt: skip


# where torch and the other installed packages lie: loading a library from there stays allowed
PACKAGE_DIRS = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
with contextlib.suppress(AttributeError):  # site.getsitepackages: missing in old virtualenvs
    PACKAGE_DIRS.update(site.getsitepackages())
_SITE_PACKAGES = tuple(os.path.realpath(p) + os.sep for p in PACKAGE_DIRS)


def _rules_apply() -> bool:
    return _state["always"] or _state["installed"] and graded_call_running()


def _refused(event: str, args: tuple) -> bool:
    """Whether the audit event `event` (of `_REFUSED`) is refused now: all are while the rules
    apply, but loading a library that lies in site-packages (torch does on import) and a signal
    to this process."""
    if not _rules_apply():
        return False
    if event in ("os.kill", "os.killpg"):
        return not (event == "os.kill" and args and args[0] == os.getpid())
    if event == "ctypes.dlopen":
        path = args[0] if args else None
        absolute = isinstance(path, str) and os.path.isabs(path)
        return not (absolute and os.path.realpath(path).startswith(_SITE_PACKAGES))
    return True


def _audit(event: str, args: tuple) -> None:
    if event in _REFUSED:
        if _refused(event, args):
            raise GradingError(
                f"{event} is not allowed while your code is graded: it runs without creating "
                "processes or using ctypes (threads are fine)"
            )
        return
    if event != "object.__setattr__" or not (_state["installed"] and graded_call_running()):
        return
    if len(args) >= 3 and args[1] == "__code__" and type(args[0]) is types.FunctionType:
        if id(args[0].__code__) in _GUARDED_IDS:
            raise GradingError("a guarded kvlib function's code cannot be replaced while graded")


def _install_audit_hook() -> None:
    """The audit hook, and `_posixsubprocess.fork_exec` refused while the rules apply (the way
    subprocess and multiprocessing start a process raises no audit event called directly)."""
    if _state.get("audit_hook"):
        return
    sys.addaudithook(_audit)  # for the life of the process: an audit hook cannot be removed
    _state["audit_hook"] = True
    try:
        import _posixsubprocess
    except ImportError:  # Windows
        return
    original = _posixsubprocess.fork_exec

    def fork_exec(*args, **kwargs):
        if _rules_apply():
            raise GradingError(
                "creating a process is not allowed while your code is graded (threads are fine)"
            )
        return original(*args, **kwargs)

    _posixsubprocess.fork_exec = fork_exec


def forbid_processes() -> None:
    """From now on, for the life of this process (the grader's child), refuse what the audit
    hook refuses while a graded call runs: processes, signals to others, ctypes."""
    _state["always"] = True
    _install_audit_hook()
