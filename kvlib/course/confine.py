"""What the operating system enforces and measures about the learner's process. Where the grader
runs as root on Linux its child: runs in a mount namespace of its own where kvlib's folders hold
only a minimal package (`minimal_package`: the helpers the questions allow, stubs that raise for
the rest), /proc hides other processes and temporary folders are a private tmpfs (`isolate`);
drops to an unprivileged user; cannot create processes (a seccomp filter: `fork`, `vfork`,
`execve` and `clone` without `CLONE_THREAD` fail; threads are fine); and has its peak memory
counted by the kernel in a memory cgroup the grader makes for it (`CgroupMemory`). Where it runs
as another user, the peak resident memory is read from /proc (`PeakMemory`, which the child can
reset: best effort).

The same process rules at the Python level (`process_refused`, `wrap_fork_exec`) are applied by
`kvlib.course.guards`' audit hook. Each OS-level piece says whether it took effect
(`Confinement`); where the platform lacks it (macOS, Windows, a kernel without namespaces or
seccomp) the grader still runs, with the Python-level rules only, and the report says so. It does
not limit the network or the CPU: those need a container (see book/setup.md).

Sources: seccomp(2), capabilities(7), prctl(2), proc(5), mount_namespaces(7), the kernel's
cgroup-v1 memory.rst and cgroup-v2.rst; Docker's default seccomp profile answers `clone3` with
ENOSYS in the same way, so that glibc falls back to `clone`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import stat
import struct
import sys

UNPRIVILEGED_USER = "nobody"
# malloc settings for the child (glibc): every block of 64 KiB or more is its own mapping, given
# back when freed, so that a large temporary shows in the peak resident memory
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


@dataclasses.dataclass
class Confinement:
    """What the child's confinement achieved (for the report)."""

    user: str = "the grader's own user"
    processes: str = "refused by Python's audit hooks only"
    sight: str = "kvlib visible, guarded at the Python level only"

    def describe(self) -> str:
        return f"learner code runs as {self.user}; process creation {self.processes}; {self.sight}"


def unprivileged_ids() -> tuple[int, int]:
    """(uid, gid) of the `nobody` user (65534 where it is not in the user database)."""
    try:
        import pwd

        entry = pwd.getpwnam(UNPRIVILEGED_USER)
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return 65534, 65534


def _readable_by_others(paths) -> bool:
    """Whether a user with no ownership can reach every path (x on each ancestor, r on it)."""
    for path in paths:
        path = os.path.abspath(path)
        if not os.path.exists(path):
            continue
        parts = [path]
        while os.path.dirname(parts[-1]) != parts[-1]:
            parts.append(os.path.dirname(parts[-1]))
        for index, part in enumerate(parts):
            mode = os.stat(part).st_mode
            need = stat.S_IROTH if index == 0 else 0
            need |= stat.S_IXOTH if stat.S_ISDIR(mode) else 0
            if mode & need != need:
                return False
    return True


# --- the libc calls (Linux) -----------------------------------------------------------------------

_PR_SET_KEEPCAPS, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP = 8, 38, 22
_SECCOMP_MODE_FILTER = 2
_CAP_VERSION_3 = 0x20080522
_CAP_DAC_READ_SEARCH = 2


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]  # fmt: skip
    return ctypes, libc


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _set_capabilities(ctypes, libc, keep: int) -> None:
    """Effective and permitted capabilities: the bits of `keep` only (none inheritable)."""
    header = struct.pack("<Ii", _CAP_VERSION_3, 0)
    data = struct.pack("<6I", keep, keep, 0, 0, 0, 0)  # two (effective, permitted, inheritable)
    header_buf, data_buf = ctypes.create_string_buffer(header), ctypes.create_string_buffer(data)
    _check(libc.capset(header_buf, data_buf), "capset")


def drop_privileges(read_paths) -> str:
    """Become the unprivileged user (call as root, before any learner code runs). Keeps
    CAP_DAC_READ_SEARCH (read any file, write none) only where `read_paths` (the interpreter, the
    packages, the notebook's folder) are not readable by other users, as under a root-only home
    folder. Returns who the process now is."""
    uid, gid = unprivileged_ids()
    keep_reading = not _readable_by_others(read_paths)
    ctypes, libc = _libc()
    _check(libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    _set_capabilities(ctypes, libc, (1 << _CAP_DAC_READ_SEARCH) if keep_reading else 0)
    _check(libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    who = f"{UNPRIVILEGED_USER} (uid {uid})"
    return who + (", allowed to read every file" if keep_reading else "")


# --- no new processes: a seccomp filter -----------------------------------------------------------

# (audit arch, clone, clone3, syscalls refused outright) per machine
_SYSCALLS = {
    "x86_64": (0xC000003E, 56, 435, (57, 58, 59, 322)),  # fork, vfork, execve, execveat
    "aarch64": (0xC00000B7, 220, 435, (221, 281)),  # execve, execveat (no fork or vfork)
}
_CLONE_THREAD = 0x00010000
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06


def _filter(arch: int, clone: int, clone3: int, refused: tuple[int, ...]) -> bytes:
    """The BPF program: another ABI (x32, i386) -> EPERM; clone3 -> ENOSYS (glibc then uses
    clone); clone -> allowed only with CLONE_THREAD; the refused calls -> EPERM; else allowed.
    A jump's offsets count instructions after the next one (jt if the test holds, else jf)."""
    eperm, enosys, n = _RET_ERRNO | _EPERM, _RET_ERRNO | _ENOSYS, len(refused)
    program = [
        (_LD_W_ABS, 0, 0, 4),  # 0: seccomp_data.arch
        (_JEQ_K, 1, 0, arch),  # 1: the native ABI -> 3
        (_RET_K, 0, 0, eperm),  # 2
        (_LD_W_ABS, 0, 0, 0),  # 3: seccomp_data.nr
        (_JSET_K, 0, 1, 0x40000000),  # 4: the x32 ABI's numbers -> 5, else 6
        (_RET_K, 0, 0, eperm),  # 5
        (_JEQ_K, 0, 1, clone3),  # 6: clone3 -> 7, else 8
        (_RET_K, 0, 0, enosys),  # 7
        (_JEQ_K, 0, 3, clone),  # 8: clone -> 9, else the refused list at 12
        (_LD_W_ABS, 0, 0, 16),  # 9: the low half of args[0], clone's flags
        (_JSET_K, n + 1, 0, _CLONE_THREAD),  # 10: a thread -> allow (12 + n), else 11
        (_RET_K, 0, 0, eperm),  # 11
        *((_JEQ_K, n - i, 0, nr) for i, nr in enumerate(refused)),  # 12 ..: -> 13 + n
        (_RET_K, 0, 0, _RET_ALLOW),  # 12 + n
        (_RET_K, 0, 0, eperm),  # 13 + n
    ]
    return b"".join(struct.pack("<HBBI", *instruction) for instruction in program)


def forbid_processes() -> bool:
    """Install the seccomp filter in this process (for good: every thread made after it, and
    nothing can remove it). False where the platform has none."""
    if sys.platform != "linux" or platform.machine() not in _SYSCALLS:
        return False
    ctypes, libc = _libc()
    program = _filter(*_SYSCALLS[platform.machine()])
    buffer = ctypes.create_string_buffer(program)
    prog = struct.pack("<HxxxxxxQ", len(program) // 8, ctypes.addressof(buffer))
    prog_buffer = ctypes.create_string_buffer(prog)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    try:
        _check(
            libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog_buffer), 0, 0),
            "prctl(PR_SET_SECCOMP)",
        )
    except OSError:
        return False
    return True


def limit_processes(extra: int) -> None:
    """RLIMIT_NPROC: the tasks this user already has plus `extra` (threads count on Linux, so
    this bounds a runaway, it does not forbid one process: the seccomp filter does that)."""
    import resource

    uid, count = os.getuid(), 0
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == uid:
                        count += len(os.listdir(f"/proc/{entry.name}/task"))
    limit = count + extra
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))


# --- peak memory, measured by the kernel ---------------------------------------------------------

BALLAST_MARGIN = 2 * 2**20  # usage falling this far below a window's start voids the measurement


def _own_cgroup() -> tuple[str, str] | None:
    """("v1" or "v2", the folder of this process's memory cgroup), or None."""
    with contextlib.suppress(OSError):
        with open("/proc/self/cgroup") as table:
            for line in table:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    return "v1", "/sys/fs/cgroup/memory" + path
            unified = [p for p in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
                       if os.path.exists(p + "/cgroup.controllers")]  # fmt: skip
            if unified and line.startswith("0::"):
                return "v2", unified[0] + line.rstrip("\n")[3:]
    return None


class CgroupMemory:
    """The memory of one child process counted by the kernel, in a memory cgroup of its own that
    the grader (root) makes and the child cannot write to: anonymous memory, the page cache of
    files it writes, tmpfs. A window: `open()` resets the cgroup's peak to its usage and (v1)
    asks the kernel to signal usage falling `BALLAST_MARGIN` below it; `close()` returns (peak
    rise in bytes, whether usage fell that far). v1's `memory.max_usage_in_bytes`, or v2's
    `memory.peak` (reset per file descriptor: Linux 6.12+). `available` is False where the
    grader cannot make one (not root, no memory controller). Source: the kernel's cgroup-v1
    memory.rst (usage thresholds) and cgroup-v2.rst."""

    _count = 0

    def __init__(self, pid: int):
        self.path = self.version = None
        self._fds: list[int] = []
        own = _own_cgroup() if sys.platform == "linux" and os.geteuid() == 0 else None
        if own is None:
            return
        CgroupMemory._count += 1
        path = f"{own[1]}/kvlib-grade-{os.getpid()}-{CgroupMemory._count}"
        try:
            os.mkdir(path)
            with open(f"{path}/cgroup.procs", "w") as procs:
                procs.write(str(pid))
            self.path, self.version = path, own[0]
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)

    @property
    def available(self) -> bool:
        return self.path is not None

    def _read(self, name: str) -> int:
        with open(f"{self.path}/{name}") as file:
            return int(file.read().split()[0])

    def open(self) -> None:
        self._close_fds()
        if self.version == "v1":
            with open(f"{self.path}/memory.max_usage_in_bytes", "w") as peak:
                peak.write("0")  # the peak becomes the usage now
            self.base = self._read("memory.usage_in_bytes")
            if self.base > BALLAST_MARGIN:
                event = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                usage = os.open(f"{self.path}/memory.usage_in_bytes", os.O_RDONLY | os.O_CLOEXEC)
                self._fds = [event, usage]
                with open(f"{self.path}/cgroup.event_control", "w") as control:
                    control.write(f"{event} {usage} {self.base - BALLAST_MARGIN}")
        else:
            peak = os.open(f"{self.path}/memory.peak", os.O_RDWR | os.O_CLOEXEC)
            self._fds = [peak]
            os.write(peak, b"reset")  # OSError before Linux 6.12: no window
            self.base = self._read("memory.current")

    def close(self) -> tuple[int, bool]:
        if self.version == "v1":
            peak, fell = self._read("memory.max_usage_in_bytes"), False
            if self._fds:
                with contextlib.suppress(BlockingIOError):
                    fell = os.eventfd_read(self._fds[0]) > 0
        else:
            os.lseek(self._fds[0], 0, os.SEEK_SET)
            peak, fell = int(os.read(self._fds[0], 64).split()[0]), False
        self._close_fds()
        return max(0, peak - self.base), fell

    def _close_fds(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    def remove(self) -> None:
        """Remove the cgroup (once its process has ended)."""
        self._close_fds()
        if self.path is not None:
            for _ in range(50):
                try:
                    os.rmdir(self.path)
                    break
                except OSError:
                    import time

                    time.sleep(0.02)
            self.path = None


class PeakMemory:
    """Where no cgroup is available (the grader not root, check()'s grader): the peak resident
    memory of process `pid` read from /proc by another process of the same user. `open()` resets
    the kernel's high-water mark (`clear_refs` 5) and notes the resident size, `close()` returns
    how far the high-water mark rose above it (the process measured can reset it too: best
    effort). `available` is False where /proc lacks either. Source: proc(5)."""

    def __init__(self, pid: int):
        self.pid, self.base = pid, 0
        try:
            self.open()
            self.available = True
        except OSError:
            self.available = False

    def _status_kib(self, field: str) -> int:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise OSError(f"/proc/{self.pid}/status has no {field}")

    def open(self) -> None:
        with open(f"/proc/{self.pid}/clear_refs", "w") as clear:
            clear.write("5")
        self.base = self._status_kib("VmRSS")

    def close(self) -> tuple[int, bool]:
        return max(0, self._status_kib("VmHWM") - self.base) * 1024, False


# --- no new processes: the Python-level rules (kvlib.course.guards' audit hook applies them) ------

PROCESS_EVENTS = frozenset(
    {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
     "os.startfile", "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg"}
)  # fmt: skip
CTYPES_EVENTS = frozenset(
    {"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function",
     "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.addressof", "ctypes.string_at",
     "ctypes.wstring_at", "ctypes.create_string_buffer", "ctypes.create_unicode_buffer",
     "ctypes.get_errno", "ctypes.set_errno", "ctypes.PyObj_FromPtr"}
)  # fmt: skip


@functools.lru_cache(maxsize=1)
def _site_packages() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    with contextlib.suppress(AttributeError):
        paths.update(site.getsitepackages())
    return tuple(os.path.realpath(p) + os.sep for p in paths)


def process_refused(event: str, args: tuple, rules_apply: bool) -> bool:
    """Whether the audit event `event` is refused: one that creates a process, signals another
    process, or uses ctypes, while `rules_apply` (but loading a library that lies in
    site-packages, as torch does on import, and a signal to this process)."""
    if not rules_apply or event not in PROCESS_EVENTS and event not in CTYPES_EVENTS:
        return False
    if event in ("os.kill", "os.killpg"):
        return not (event == "os.kill" and args and args[0] == os.getpid())
    if event == "ctypes.dlopen":  # a package's own library (torch loads one on import)
        path = args[0] if args else None
        return not (
            isinstance(path, str)
            and os.path.isabs(path)
            and os.path.realpath(path).startswith(_site_packages())
        )
    return True


def wrap_fork_exec(rules_apply, error) -> None:
    """subprocess's and multiprocessing's way to start a process, `_posixsubprocess.fork_exec`,
    raises no audit event of its own when called directly: refuse it (`error(message)`) while
    `rules_apply()`."""
    try:
        import _posixsubprocess
    except ImportError:  # Windows
        return
    original = _posixsubprocess.fork_exec

    def fork_exec(*args, **kwargs):
        if rules_apply():
            raise error("creating a process is not allowed while your code is graded (threads "
                        "are fine)")  # fmt: skip
        return original(*args, **kwargs)

    _posixsubprocess.fork_exec = fork_exec


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
    else a stub that raises when called; `check` and `show` silent. Nothing else of kvlib."""
    import ast

    wanted: dict[str, set[str]] = {"course.grading": {"check", "show"}}
    for cell in cells:
        with contextlib.suppress(SyntaxError, ValueError):
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
            if dotted in allowed and os.path.isfile(real):
                body.append(_helper_source(real, name))
            else:
                stub = _CLASS_STUB if _is_class(f"kvlib.{module}", name) else _STUB
                body.append(stub.format(dotted=dotted, name=name))
        if module != "course.grading":
            body.append(_MODULE_STUB.format(module="kvlib." + module))
        files["/".join(parts) + ".py"] = "\n\n".join(body)
    return files


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
    for folder in kvlib_dirs:
        mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=8m,mode=755")
        for relative, text in files.items():
            path = os.path.join(folder, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as file:
                file.write(text)
        mount(None, folder, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
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
    if home is not None:
        os.makedirs(home, exist_ok=True)
        os.chown(home, *unprivileged_ids())
    mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
    return (
        "kvlib hidden in a mount namespace (only the helpers the questions allow), /proc "
        "without other users' processes, a private tmpfs for temporary files"
    )
