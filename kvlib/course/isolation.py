"""kvlib out of the learner's sight (Linux, the grader root, unless KVLIB_GRADE_ISOLATION=0): the
grader's child enters a mount namespace of its own where kvlib's folders hold only a minimal
package (`minimal_package`), /proc hides other processes and temporary folders are a private
tmpfs (`isolate`). Source: mount_namespaces(7), mount(2), proc(5).
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys

from kvlib.course.confine import _check, _libc, unprivileged_ids

_CLONE_NEWNS, _MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x20000, 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 0x4000, 0x40000
_UNAVAILABLE = "is unavailable while your notebook is graded: write it yourself"
# the end of every module of the minimal package: any name it does not define is a stand-in
_OTHER_NAMES = (
    "def __getattr__(name):\n"
    "    from kvlib.course.isolation import stand_in\n\n"
    "    return stand_in(f'{__name__}.{name}')\n"
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


def minimal_package(allowed, kvlib_dir: str) -> dict[str, str]:
    """The files of the `kvlib` the learner's process sees ({path in the package: text}): the
    functions and classes the questions allow (`allowed`: dotted names), `check` and `show`
    silent, `require_triton` reduced to setting up Triton, and in each of their modules every
    other name a stand-in that raises when called (`stand_in`); every other kvlib module is one
    of stand-ins too (`UnavailableModules`). Nothing else of kvlib."""
    grading = "from kvlib.course.checking import CHECKED_WHILE_GRADING, check, show\n"
    written: dict[str, list[str]] = {"course.grading": [grading]}
    for dotted in sorted({*allowed, *ALWAYS_WRITTEN}):
        module, name = dotted.removeprefix("kvlib.").rsplit(".", 1)
        real = os.path.join(kvlib_dir, *module.split(".")) + ".py"
        if dotted in ALWAYS_WRITTEN:
            written.setdefault(module, []).append(ALWAYS_WRITTEN[dotted])
        elif os.path.isfile(real):
            written.setdefault(module, []).append(_helper_source(real, name))
    files = {"course/checking.py": _GRADING_STUB}
    for module, body in written.items():
        parts = module.split(".")
        for depth in range(len(parts)):
            files.setdefault("/".join([*parts[:depth], "__init__.py"]), _OTHER_NAMES)
        files["/".join(parts) + ".py"] = "\n\n".join([*body, _OTHER_NAMES])
    return files


class UnavailableModules:
    """A `sys.meta_path` finder, last in line: a kvlib module the minimal package lacks imports as
    one whose every name is a stand-in (`stand_in`), naming itself (instead of a
    ModuleNotFoundError that does not say why)."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("kvlib."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        module.__getattr__ = lambda name: stand_in(f"{module.__name__}.{name}")


def stand_in(dotted: str) -> type:
    """A stand-in for kvlib's `dotted`, function or class alike: calling it raises RuntimeError,
    naming it; its attributes (a method: `H2O.observe`), and an instance's made without calling
    it, are stand-ins too. A dunder name (`__file__`: its source is not here either) raises
    AttributeError."""
    if dotted.rsplit(".", 1)[-1].startswith("__"):
        raise AttributeError(f"{dotted} {_UNAVAILABLE}")

    def attribute(owner, name):
        return stand_in(f"{dotted}.{name}")

    class Unavailable(type):
        def __call__(cls, *args, **kwargs):
            raise RuntimeError(f"{dotted} {_UNAVAILABLE}")

        __getattr__ = attribute

    return Unavailable(dotted.rsplit(".", 1)[-1], (), {"__getattr__": attribute})


def isolate(kvlib_dirs: list[str], files: dict[str, str], home: str | None, keep=()) -> str:
    """Put this process (root, before it drops privileges) in a mount namespace of its own where
    kvlib's folders (`kvlib_dirs`: its source tree, its installed copy) hold only `files`
    (read-only), /proc shows no other user's processes (`hidepid=2`), and /tmp, /var/tmp,
    /dev/shm and /run/lock are a private tmpfs (its pages are charged to the process's memory;
    folders of `keep` there are bound back read-only): nothing a child writes outlives it.
    Raises OSError where the kernel refuses. Returns what it did. Source: mount_namespaces(7),
    proc(5)."""
    ctypes, libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

    def mount(source, target, fstype, flags, data=None):
        args = [x.encode() if isinstance(x, str) else x for x in (source, target, fstype)]
        data = data.encode() if data else None
        _check(libc.mount(*args, flags, data), f"mount {target}")

    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):  # the world-writable folders
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
    sys.meta_path.append(UnavailableModules())
    return (
        "kvlib hidden in a mount namespace (only the helpers the questions allow), /proc "
        "without other users' processes, a private tmpfs for temporary files"
    )
