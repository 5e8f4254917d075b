"""Default-deny while a graded call runs: kvlib is unavailable to the learner's code, except the
helpers its question allows, and no process may be created.

**kvlib.** While a graded call runs (`call_learner`, or a thread it started), a function of
kvlib's library or of the check modules called by anything but kvlib library code raises
GradingError, unless the question allows it (`@question(allowed=...)`). Every function of every
imported kvlib module (and of each imported later: an import hook) is recompiled from its source
with a first statement that calls the guard, held as a constant of the code.

**Copies** of kvlib's code compiled again from its source are matched by content
(`_fingerprint`) and guarded too: a best effort that the mount namespace (`kvlib.course.isolation`)
makes moot where it applies; a copy retyped with a change is the learner's own code.

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
import contextlib
import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import mmap
import os
import sys
import types
import warnings
import zlib
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
_COPIES: dict[tuple, dict[str, tuple[str, types.CodeType]]] = {}  # see _copy_of
_FOREIGN: dict[tuple, dict[str, str]] = {}  # copy_table() of the grader: modules not imported here


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
    """Puts `_PLACEHOLDER("module.qualname")` first in every function (after its docstring);
    `standalone` collects each function compiled on its own, before that, as a copy made from its
    source would be (Python 3.11 compiles `np.max(...)` differently inside a module that imports
    np): {(qualname, first line): code}."""

    def __init__(self, module: str, filename: str = "<kvlib>"):
        self.module, self.filename, self.stack = module, filename, []
        self.standalone: dict = {}

    def _compile_alone(self, node) -> None:
        with contextlib.suppress(SyntaxError, ValueError, TypeError):
            unit = ast.Module(body=[node], type_ignores=[])
            code = compile(unit, self.filename, "exec", dont_inherit=True)
            for const in code.co_consts:
                if isinstance(const, types.CodeType) and const.co_name == node.name:
                    qualname = ".".join([*self.stack, node.name])
                    self.standalone[(qualname, const.co_firstlineno)] = const

    def visit_ClassDef(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def visit_FunctionDef(self, node):
        self._compile_alone(node)
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
        original = compile(tree, filename, "exec", dont_inherit=True)
        prologues = _Prologues(module, filename)
        prologues.visit(tree)
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
    copies = [((code.co_qualname, code.co_firstlineno), code) for code in _walk(original)]
    for key, code in [*copies, *prologues.standalone.items()]:
        match = table.get(key)
        if match is not None and _copy_key(code) is not None:
            entry = (f"{module}.{key[0]}", match)
            _COPIES.setdefault(_copy_key(code), {})[_fingerprint(code)] = entry
    return table


def _fingerprint(code: types.CodeType) -> str:
    """What a code object computes, whatever its name, file and lines: its bytecode, names,
    local names, arguments and constants (nested code objects by their own fingerprints)."""
    digest = hashlib.sha256()
    parts = [
        code.co_code,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_argcount,
        code.co_kwonlyargcount,
        code.co_flags & 0xFFFF,
    ]  # fmt: skip (__future__ flags off)
    parts += [_fingerprint(c) if isinstance(c, types.CodeType) else c for c in code.co_consts]
    for part in parts:
        digest.update(part if isinstance(part, bytes) else repr(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()


_COPY_MIN_BYTES = 100  # shorter code (`return self.shape[0]`) is anybody's: not matched as a copy


def _copy_key(code: types.CodeType) -> tuple[int, int] | None:
    if len(code.co_code) < _COPY_MIN_BYTES:
        return None
    return len(code.co_code), zlib.crc32(code.co_code)


def _copy_of(code: types.CodeType) -> tuple[str, types.CodeType | None] | None:
    """(dotted name, guarded code) of the kvlib function `code` is a copy of, or None; the code
    is None for a function of a module this process has not imported."""
    key = _copy_key(code)
    if key is None or (key not in _COPIES and key not in _FOREIGN):
        return None
    fingerprint = _fingerprint(code)
    match = _COPIES.get(key, {}).get(fingerprint)
    if match is not None:
        return match
    dotted = _FOREIGN.get(key, {}).get(fingerprint)
    return None if dotted is None else (dotted, None)


@functools.lru_cache(maxsize=1)
def copy_table() -> dict[tuple, dict[str, str]]:
    """{(bytecode length, CRC-32): {fingerprint: dotted name}} of every function in kvlib's
    library and check modules, imported or not (the grader sends it to the learner's side, which
    then recognises a copy of a module it never imported)."""
    table: dict = {}
    for path in sorted(Path(_KVLIB_DIR).rglob("*.py")):
        module = _module_name(str(path))
        if module is None:
            continue
        with contextlib.suppress(OSError, SyntaxError, ValueError):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            codes = list(_walk(compile(tree, str(path), "exec", dont_inherit=True)))[1:]
            alone = _Prologues(module, str(path))
            alone.visit(tree)  # (the prologues go into this parse only)
            named = [(code.co_qualname, code) for code in codes]
            named += [(qualname, code) for (qualname, _), code in alone.standalone.items()]
            for qualname, code in named:
                if _copy_key(code) is not None:
                    entry = table.setdefault(_copy_key(code), {})
                    entry[_fingerprint(code)] = f"{module}.{qualname}"
    return table


def _import_owner(dotted: str) -> None:
    """Import the module that defines `dotted` and compile its guarded code (a copy of its
    functions then finds them in _COPIES)."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(".".join(parts[:split]))
            _guarded_codes(getattr(module, "__file__", None) or "")
            return


def _guard_function(fn: types.FunctionType) -> None:
    """Give `fn` its guarded code: kvlib's own functions by file and line, copies by content."""
    code = fn.__code__
    if (
        id(code) in _GUARDED_IDS
        or code.co_filename.startswith(_COURSE_DIR)
        and not (code.co_filename.startswith(_CHECKS_DIR))
    ):
        return  # guarded already, or the grading machinery's own
    if _module_name(code.co_filename) is not None:
        guarded = _guarded_codes(code.co_filename).get((code.co_qualname, code.co_firstlineno))
    else:
        match = _copy_of(code)
        if match is not None and match[1] is None:  # a copy of a module not imported here
            _import_owner(match[0])
            match = _copy_of(code)
        guarded = None if match is None else match[1]
    if guarded is not None and guarded.co_freevars == code.co_freevars:
        _ORIGINAL.setdefault(id(fn), (fn, code))
        fn.__code__ = guarded


def install_guards(allowed: tuple[str, ...], question_id: str, copies: dict | None = None) -> None:
    """Guard every kvlib function (and copy of one) in this process; while question
    `question_id` is graded, the learner's code may call the kvlib functions `allowed` (dotted
    names; a class allows its methods) and no other. `copies`: the grader's `copy_table()`."""
    import gc

    _state.update(question=question_id, allowed=tuple(allowed), installed=True)
    for key, entries in (copies or {}).items():
        _FOREIGN.setdefault(key, {}).update(entries)
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


# --- the audit hook: copies of kvlib's code, processes --------------------------------------------

_CODE_EVENTS = frozenset({"exec", "function.__new__", "object.__setattr__"})
_EVENTS = _CODE_EVENTS | confine.PROCESS_EVENTS | confine.CTYPES_EVENTS


def _audit(event: str, args: tuple) -> None:
    if event not in _EVENTS:
        return
    if event not in _CODE_EVENTS:
        rules_apply = _state["always"] or _state["installed"] and graded_call_running()
        if confine.process_refused(event, args, rules_apply):
            raise GradingError(
                f"{event} is not allowed while your code is graded: it runs without creating "
                "processes or using ctypes (threads are fine)"
            )
        return
    if not (_state["installed"] and graded_call_running()):
        return
    if event == "object.__setattr__":
        if len(args) < 3 or args[1] != "__code__":
            return
        if isinstance(args[0], types.FunctionType) and id(args[0].__code__) in _GUARDED_IDS:
            raise GradingError("a guarded kvlib function's code cannot be replaced while graded")
        code = args[2]
    else:
        code = args[0] if args else None
    if not isinstance(code, types.CodeType) or _LIBRARY.get(id(code)) is code:
        return
    for nested in _walk(code):
        match = _copy_of(nested)
        if match is not None and not _allowed(match[0]):
            raise GradingError(_unavailable(match[0]) + "; copies of its code included")


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
