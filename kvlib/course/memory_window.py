"""The peak memory of the learner's process over a window the grader opens and closes, measured
from outside it (`memory_window`): by the kernel in a memory cgroup of its own (`CgroupMemory`,
the grader root on Linux), else from /proc (`PeakMemory`, best effort: the process can reset it).

Sources: the kernel's cgroup-v1 memory.rst (usage thresholds, `max_usage_in_bytes`) and
cgroup-v2.rst (`memory.peak`); proc(5) (`clear_refs`, `VmHWM`).
"""

from __future__ import annotations

import contextlib
import os
import sys

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
    `memory.peak` (reset per file descriptor: Linux 6.12+). Without one (not root, no memory
    controller) `open()` raises. The cgroup's limit is half the machine's memory (past it the
    kernel ends the child: its question fails). Source: the kernel's cgroup-v1 memory.rst (usage
    thresholds) and cgroup-v2.rst."""

    measure = "the kernel's count"  # what the grader's report says measured the peak

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
            limit = "memory.limit_in_bytes" if own[0] == "v1" else "memory.max"
            with contextlib.suppress(OSError), open(f"{path}/{limit}", "w") as file:  # bounded
                file.write(str(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2))
            with open(f"{path}/cgroup.procs", "w") as procs:
                procs.write(str(pid))
            self.path, self.version = path, own[0]
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)

    def _read(self, name: str) -> int:
        with open(f"{self.path}/{name}") as file:
            return int(file.read().split()[0])

    baseline = None  # the usage once the grader's own imports are done (`mark_baseline`)
    held = None  # at the last `open()`: how far the usage was above `baseline`

    def usage(self) -> int:
        """The cgroup's memory usage now, in bytes."""
        return self._read("memory.usage_in_bytes" if self.version == "v1" else "memory.current")

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
        self.held = None if self.baseline is None else self.base - self.baseline

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
    effort). `open()` or `close()` raises OSError where /proc lacks either. Source: proc(5)."""

    measure = "/proc's high-water mark"

    def __init__(self, pid: int):
        self.pid, self.base = pid, 0

    def _status_kib(self, field: str) -> int:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise OSError(f"/proc/{self.pid}/status has no {field}")

    baseline = held = None  # as CgroupMemory's, in resident bytes

    def usage(self) -> int:
        return self._status_kib("VmRSS") * 1024

    def open(self) -> None:
        with open(f"/proc/{self.pid}/clear_refs", "w") as clear:
            clear.write("5")
        self.base = self._status_kib("VmRSS")
        self.held = None if self.baseline is None else self.base * 1024 - self.baseline

    def close(self) -> tuple[int, bool]:
        return max(0, self._status_kib("VmHWM") - self.base) * 1024, False


def memory_window(pid: int, kinds=(CgroupMemory, PeakMemory)):
    """The first of `kinds` whose window works for process `pid` here (v2 before Linux 6.12: no
    reset), or None (the process measures itself)."""
    for kind in kinds:
        memory = kind(pid)
        try:
            memory.open()
            memory.close()
            return memory
        except (OSError, AttributeError, TypeError, ValueError):
            if hasattr(memory, "remove"):
                memory.remove()
    return None
