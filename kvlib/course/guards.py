"""Blocking by provenance: while a graded call runs, the kvlib functions a question replaces are
unavailable to the learner's code, wherever it found them.

`install_guards` recompiles each blocked function in place with a first statement that asks who
called it. A call whose caller's code object is not kvlib library code (kvlib outside
kvlib/course), made while a graded call runs (`call_learner` is on the stack), raises
GradingError: every alias, re-export, default argument and reloaded copy of the function is the
same function object or gets the same guard, and no unguarded original is kept anywhere. The check
modules' functions (the oracles) are guarded for every question.

Copies made from kvlib's *source* rather than its function objects (the module executed under
another file name, `importlib.util.spec_from_file_location` on a copy, a code object taken from a
compiled module) are recognised by their bytecode, whatever their file name: at each
`install_guards` every such copy gets the guarded code, and while a graded call runs an audit hook
refuses to execute, build or assign code that matches a blocked function. A copy retyped by hand
with any change is the learner's own code, as a paste of it would be: this module does not judge
code it cannot match.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path
from threading import get_ident as _thread_id

_KVLIB_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_COURSE_DIR = str(Path(__file__).resolve().parent) + os.sep
_CHECKS_PREFIX = "kvlib.course.checks"


class GradingError(RuntimeError):
    """Raised by a kvlib function that is unavailable while the question replacing it is graded."""


def call_learner(fn, args, kwargs, grid, blocked):
    """The one frame that marks a graded call: the guards look for it on the stack and read
    `blocked` from it."""
    if grid is not None:
        return fn[grid](*args, **kwargs)
    return fn(*args, **kwargs)


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
        return _graded_call_blocked(sys._getframe(2), dispatch)

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
    dispatch = call_learner.__code__
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
            key = (code.co_name, len(code.co_code))
            _COPIES.setdefault(key, {})[_fingerprint(code)] = (dotted, candidate)
            return True
    return False


_GUARDED_CODES: dict = {}
# (name, bytecode length) -> {fingerprint: (dotted name, guarded code)} of every guarded function
_COPIES: dict[tuple[str, int], dict[str, tuple[str, types.CodeType]]] = {}


def _fingerprint(code: types.CodeType) -> str:
    """What a code object computes, whatever file and line it was compiled at: its bytecode,
    names, arguments and constants (nested code objects by their own fingerprints)."""
    digest = hashlib.sha256()
    parts = [code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_argcount,
             code.co_kwonlyargcount, code.co_flags]  # fmt: skip
    parts += [_fingerprint(c) if isinstance(c, types.CodeType) else c for c in code.co_consts]
    for part in parts:
        digest.update(part if isinstance(part, bytes) else repr(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _copy_of(code: types.CodeType) -> tuple[str, types.CodeType] | None:
    """(dotted name, guarded code) of the guarded function `code` is a copy of, or None."""
    candidates = _COPIES.get((code.co_name, len(code.co_code)))
    return None if not candidates else candidates.get(_fingerprint(code))


def _guard_copy(fn: types.FunctionType) -> None:
    """Give a function built from a guarded function's source (compiled again, under any file
    name) the guarded code: it computes the same, and asks who calls it."""
    match = _copy_of(fn.__code__)
    if match is not None and match[1].co_freevars == fn.__code__.co_freevars:
        fn.__globals__[_GUARD_NAME] = _GUARD
        fn.__code__ = match[1]


def _graded_call_blocked(frame, marker):
    """`blocked` of the graded call running now, found on this thread's stack from `frame`, or
    on any other thread's (a thread the learner's code started runs without `call_learner` on
    its own stack, but while it runs on the main thread's); None outside a graded call."""
    stacks = [frame, *(f for tid, f in sys._current_frames().items() if tid != _thread_id())]
    for frame in stacks:
        while frame is not None:
            if frame.f_code is marker:
                return frame.f_locals.get("blocked", ())
            frame = frame.f_back
    return None


def _blocked_now():
    """The names the graded call running now blocks, or None outside a graded call."""
    return _graded_call_blocked(sys._getframe(1), call_learner.__code__)


_AUDITED = frozenset({"exec", "function.__new__", "object.__setattr__"})


def _audit(event: str, args: tuple) -> None:
    """While a graded call runs, refuse to execute, build or assign code that copies a function
    it blocks (kvlib's source compiled again, under any file name)."""
    if event not in _AUDITED or not _COPIES:
        return
    if event == "object.__setattr__":
        if len(args) < 3 or args[1] != "__code__":
            return
        code = args[2]
    else:
        code = args[0] if args else None
    if not isinstance(code, types.CodeType):
        return
    blocked = _blocked_now()
    if blocked is None:
        return
    found: dict = {}
    _walk_codes(code, found)
    for nested in found.values():
        match = _copy_of(nested)
        if match is not None and (match[0] in blocked or match[0].startswith(_CHECKS_PREFIX)):
            raise GradingError(
                f"{match[0]} is unavailable while question {_state['question']!r} is graded, "
                "copies of its code included: write it yourself"
            )


def _install_audit_hook() -> None:
    if not _state.get("audit_hook"):
        sys.addaudithook(_audit)  # for the life of the process: an audit hook cannot be removed
        _state["audit_hook"] = True


def install_guards(names: tuple[str, ...], question_id: str) -> list[str]:
    """Guard the kvlib functions `names` (dotted; a class guards all its methods) and every function
    of the check modules; returns the names that could not be guarded."""
    _state["question"] = question_id
    _install_import_hook()
    _install_audit_hook()
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
    # copies: the same function from a module object since replaced in sys.modules, a
    # FunctionType built on its code before the guard was installed, or its source compiled again
    # under another file name (exec, a module loaded from a copy of the file)
    import gc

    for obj in gc.get_objects():
        if type(obj) is types.FunctionType and _GUARD_NAME not in obj.__code__.co_names:
            code = obj.__code__
            dotted = identities.get((code.co_filename, code.co_qualname))
            if dotted is not None:
                _guard_function(obj, dotted)
            else:
                _guard_copy(obj)
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


_GUARD = _make_guard()
