"""kvlib out of the learner's sight (Linux, the grader root, unless KVLIB_GRADE_ISOLATION=0): the
grader's child enters a mount namespace of its own where kvlib's folders hold only a minimal
package (`minimal_package`), /proc hides other processes and temporary folders are a private
tmpfs (`isolate`). Source: mount_namespaces(7), mount(2), proc(5).
"""

from __future__ import annotations

import contextlib
import os

from kvlib.course.confine import _check, _libc, unprivileged_ids

# --- kvlib out of sight: a mount namespace (Linux, as root) --------------------------------------

_CLONE_NEWNS, _MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x20000, 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 0x4000, 0x40000
_STUB = (
    "def {name}(*args, **kwargs):\n"
    "    raise RuntimeError('{dotted} is unavailable while your notebook is graded: write it '\n"
    "                       'yourself')\n"
)
_CLASS_STUB = (
    "class {name}:\n"
    "    def __init__(self, *args, **kwargs):\n"
    "        raise RuntimeError('{dotted}.__init__ is unavailable while your notebook is '\n"
    "                           'graded: '\n"
    "                           'write it yourself')\n"
)
_MODULE_STUB = (
    "def __getattr__(name):\n"
    "    if name.startswith('__'):\n"
    "        raise AttributeError(name)\n"
    "    def unavailable(*args, **kwargs):\n"
    "        raise RuntimeError(f'{module}.{{name}} is unavailable while your notebook is '\n"
    "                           'graded: write it yourself')\n"
    "    return unavailable\n"
)
# chapter 11's first cell: Triton under its interpreter, without kvlib.kernels
_REQUIRE_TRITON = (
    "def require_triton(what, *, interpret=False):\n"
    "    import os\n\n"
    "    import torch\n\n"
    "    if interpret or not torch.cuda.is_available():\n"
    "        os.environ['TRITON_INTERPRET'] = '1'\n"
    "    try:\n"
    "        import triton  # noqa: F401\n"
    "    except ImportError as error:\n"
    "        raise RuntimeError(f'{what}: it needs Triton') from error\n"
)
# course helpers a notebook calls while it loads, whatever its questions allow
ALWAYS_WRITTEN = {"kvlib.course.notebook.require_triton": _REQUIRE_TRITON}
_GRADING_STUB = (
    "CHECKED_WHILE_GRADING = {}\n\n\n"
    "def check(question_id, function, **kwargs):  # the grader grades every question itself\n"
    "    CHECKED_WHILE_GRADING[question_id] = function\n\n\n"
    "def show(function, *args, **kwargs):\n"
    "    pass\n"
)


def _helper_source(path: str, name: str) -> str:
    """kvlib's function `name` of file `path` alone, with its module's other imports."""
    import ast

    source = open(path, encoding="utf-8").read()
    tree = ast.parse(source)
    keep = [
        node for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and not any(a.name.startswith("kvlib") for a in node.names)
        and not (getattr(node, "module", None) or "").startswith("kvlib")
        or isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name
    ]  # fmt: skip
    return "\n\n".join(ast.get_source_segment(source, node) for node in keep) + "\n"


def _is_class(module: str, name: str) -> bool:
    import importlib

    try:
        return isinstance(getattr(importlib.import_module(module), name), type)
    except Exception:  # noqa: BLE001 - a name kvlib does not have: a function's stub
        return False


def minimal_package(cells: list[str], allowed, kvlib_dir: str) -> dict[str, str]:
    """The files of the `kvlib` the learner's process sees ({path in the package: text}): for
    every name the notebook imports from kvlib, the function itself where a question allows it,
    else a stub that raises when called; `check` and `show` silent; `require_triton` reduced to
    setting up Triton; any other kvlib module imports as one whose names raise when called.
    Nothing else of kvlib."""
    import ast

    wanted: dict[str, set[str]] = {"course.grading": {"check", "show"}}
    for cell in cells:
        # a cell the parser refuses (a syntax error, nesting past its limits) names no module
        with contextlib.suppress(SyntaxError, ValueError, RecursionError, MemoryError):
            for node in ast.walk(ast.parse(cell)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvlib."):
                    names = {a.name for a in node.names if a.name != "*"}
                    wanted.setdefault(node.module.removeprefix("kvlib."), set()).update(names)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.startswith("kvlib."):
                            wanted.setdefault(alias.name.removeprefix("kvlib."), set())
    files = {"__init__.py": "", "course/checking.py": _GRADING_STUB}
    for module, names in wanted.items():
        parts = module.split(".")
        for depth in range(1, len(parts)):
            files.setdefault("/".join(parts[:depth]) + "/__init__.py", "")
        body = []
        if module == "course.grading":
            body.append("from kvlib.course.checking import CHECKED_WHILE_GRADING, check, show\n")
            names = names - {"check", "show"}
        for name in sorted(names):
            real, dotted = os.path.join(kvlib_dir, *parts) + ".py", f"kvlib.{module}.{name}"
            if dotted in ALWAYS_WRITTEN:
                body.append(ALWAYS_WRITTEN[dotted])
            elif dotted in allowed and os.path.isfile(real):
                body.append(_helper_source(real, name))
            else:
                stub = _CLASS_STUB if _is_class(f"kvlib.{module}", name) else _STUB
                body.append(stub.format(dotted=dotted, name=name))
        if module != "course.grading":
            body.append(_MODULE_STUB.format(module="kvlib." + module))
        files["/".join(parts) + ".py"] = "\n\n".join(body)
    return files


_UNAVAILABLE = "is unavailable while your notebook is graded: write it yourself"


class UnavailableModules:
    """A `sys.meta_path` finder, last in line: a kvlib module the minimal package lacks imports as
    one whose every name raises when called, naming itself (instead of a ModuleNotFoundError that
    does not say why)."""

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery

        if name.startswith("kvlib."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        def __getattr__(name):
            if name.startswith("__"):  # __file__ and the like: its source is not here either
                raise AttributeError(f"{module.__name__}.{name} {_UNAVAILABLE}")
            return _unavailable(f"{module.__name__}.{name}")

        module.__path__ = []
        module.__getattr__ = __getattr__


def _unavailable(dotted: str) -> type:
    """A stand-in for kvlib's `dotted`, function or class alike: calling it raises, naming it;
    its attributes (a method: `H2O.observe`), and an instance's made without calling it, are
    stand-ins too."""

    def attribute(owner, name):
        if name.startswith("__"):
            raise AttributeError(f"{dotted}.{name} {_UNAVAILABLE}")
        return _unavailable(f"{dotted}.{name}")

    class Unavailable(type):
        def __call__(cls, *args, **kwargs):
            raise RuntimeError(f"{dotted} {_UNAVAILABLE}")

        __getattr__ = attribute

    return Unavailable(dotted.rsplit(".", 1)[-1], (), {"__getattr__": attribute})


def isolate(kvlib_dirs: list[str], files: dict[str, str], home: str | None, keep=()) -> str:
    """Put this process (root, before it drops privileges) in a mount namespace of its own where
    kvlib's folders (`kvlib_dirs`: its source tree, its installed copy) hold only `files`
    (read-only), /proc shows no other user's processes (`hidepid=2`), and /tmp, /var/tmp and
    /dev/shm are a private tmpfs (its pages are charged to the process's memory; folders of `keep`
    there are bound back read-only). Raises OSError
    where the kernel refuses. Returns what it did. Source: mount_namespaces(7), proc(5)."""
    ctypes, libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

    def mount(source, target, fstype, flags, data=None):
        args = [x.encode() if isinstance(x, str) else x for x in (source, target, fstype)]
        data = data.encode() if data else None
        _check(libc.mount(*args, flags, data), f"mount {target}")

    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        if not os.path.isdir(folder):
            continue
        # what the learner's code must read there (the notebook's folder) comes back read-only
        inside = [p for p in keep if os.path.isdir(p) and p.startswith(folder + os.sep)]
        fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in inside]
        mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=256m,mode=1777")
        for path, fd in zip(inside, fds):
            os.makedirs(path, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND)
            mount(None, path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID)
            os.close(fd)
    # kvlib last: a folder of `keep` under /tmp comes back as a plain bind mount, without mounts
    # made inside it before (a repository cloned under /tmp showed the real kvlib again)
    for folder in kvlib_dirs:
        if not os.path.isdir(folder):  # under a temporary folder not kept: already out of sight
            continue
        mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=8m,mode=755")
        for relative, text in files.items():
            path = os.path.join(folder, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as file:
                file.write(text)
        mount(None, folder, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    if home is not None:
        os.makedirs(home, exist_ok=True)
        os.chown(home, *unprivileged_ids())
    mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
    import sys

    sys.meta_path.append(UnavailableModules())
    return (
        "kvlib hidden in a mount namespace (only the helpers the questions allow), /proc "
        "without other users' processes, a private tmpfs for temporary files"
    )
