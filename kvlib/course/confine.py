"""What the operating system enforces about the learner's process (Linux): the grader's child, as
root, drops to an unprivileged user (`drop_privileges`, `limit_processes`) and then cannot create
processes (`forbid_processes`: a seccomp filter; `fork`, `vfork`, `execve` and `clone` without
`CLONE_THREAD` fail, threads are fine). Each says whether it took effect; where a piece is missing
the Python-level rules of `kvlib.course.guards` remain (book/grader_guarantees.md).

Sources: seccomp(2), capabilities(7), prctl(2); Docker's default seccomp profile (clone3).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import stat
import struct
import sys
from pathlib import Path

UNPRIVILEGED_USER = "nobody"
# malloc settings for the child (glibc): every block of 64 KiB or more is its own mapping, given
# back when freed, so that a large temporary shows in the peak resident memory
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


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
        for index, part in enumerate([path, *Path(path).parents]):
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
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]  # fmt: skip
    return ctypes, libc


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


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
    keep = (1 << _CAP_DAC_READ_SEARCH) if keep_reading else 0  # effective and permitted only
    header = ctypes.create_string_buffer(struct.pack("<Ii", _CAP_VERSION_3, 0))
    data = struct.pack("<6I", keep, keep, 0, 0, 0, 0)  # two (effective, permitted, inheritable)
    _check(libc.capset(header, ctypes.create_string_buffer(data)), "capset")
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
    address = ctypes.addressof(prog_buffer)
    return libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, address, 0, 0) == 0


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
