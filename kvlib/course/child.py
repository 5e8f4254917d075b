"""The grader's child process, seen from the grader (`_ChildSide`): started confined, with the
notebook's cells executed one by one (a cell that hangs or ends the process is skipped in a fresh
child), then serving the test's requests over numbered frames (`kvlib.course.wire`); its memory
measured from outside (`kvlib.course.memory_window`), and, on Linux as root (unless
KVLIB_GRADE_ISOLATION=0), kvlib out of its sight (`kvlib.course.isolation`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from kvlib.course.confine import MALLOC_ENV, unprivileged_ids
from kvlib.course.grading import MESSAGE_CHARS, ProcessEnded, QuestionTimeout
from kvlib.course.guards import PACKAGE_DIRS
from kvlib.course.isolation import minimal_package
from kvlib.course.memory_window import memory_window
from kvlib.course.wire import Channel, ChannelClosed, ChannelTimeout, Unsolicited


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLIB_")}
    # Triton kernels are graded under the interpreter on every machine (CPU tensors, exact)
    env.update(MPLBACKEND="Agg", PYTHONHASHSEED="0", TRITON_INTERPRET="1")
    return env


def _sandbox_env(home: str | None) -> dict:
    """The grader's child's environment: child_env(), glibc's malloc returning large blocks
    (kvlib.course.confine.MALLOC_ENV), and a home of its own where it runs as another user."""
    env = {**child_env(), **MALLOC_ENV}
    if home is not None:
        env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"),
                   MPLCONFIGDIR=os.path.join(home, ".matplotlib"),
                   TRITON_CACHE_DIR=os.path.join(home, ".triton"))  # fmt: skip
    return env


def _child_home() -> str | None:
    """Where the grader runs as root: a fresh folder owned by the unprivileged user the child
    becomes (its HOME, for caches); else None."""
    if os.name != "posix" or os.geteuid() != 0:
        return None
    home = tempfile.mkdtemp(prefix="kvlib-grade-")
    os.chown(home, *unprivileged_ids())
    return home


def _read_paths(cells_folder: str | None) -> list[str]:
    """What the learner's code must be able to read: the interpreter, the packages, kvlib, the
    notebook's folder and the working folder."""
    paths = [sys.prefix, sys.base_prefix, os.getcwd(), str(Path(__file__).resolve().parents[2])]
    paths += [sysconfig.get_paths()["stdlib"], *sorted(PACKAGE_DIRS)]
    return paths + ([cells_folder] if cells_folder else [])


# the mount namespace where the kernel allows it (Linux, the grader root); "0" turns it off
ENV_ISOLATION = "KVLIB_GRADE_ISOLATION"


def _package(allowed, home: str | None) -> dict | None:
    """What the child needs to hide kvlib in a mount namespace of its own (Linux, the grader
    root): kvlib's folders and the minimal package shown there instead; None elsewhere."""
    if sys.platform != "linux" or os.geteuid() != 0 or os.environ.get(ENV_ISOLATION) == "0":
        return None
    kvlib_dir = str(Path(__file__).resolve().parents[1])
    dirs = {kvlib_dir}
    spec = importlib.util.find_spec("kvlib")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        dirs.add(str(Path(folder).resolve()))
    return {"dirs": sorted(dirs), "files": minimal_package(allowed, kvlib_dir), "home": home}


class _ChildSide:
    """A child process that executed the notebook's cells and serves the test's calls. A cell that
    hangs or ends the process is skipped in a fresh child; a call that does either ends the child
    (killed from here: nothing the learner's code catches) and fails the question."""

    def __init__(self, cells: list[str], timeout_s: float, names: list[str],
                 folder: str | None = None, skip: dict[int, str] | None = None,
                 allowed: tuple[str, ...] = (), profiled: bool = False):  # fmt: skip
        self.cells, self.timeout_s, self.names, self.folder = cells, timeout_s, names, folder
        self.allowed, self.profiled, self.process, self.memory = allowed, profiled, None, None
        self.home, self.confinement = None, ""
        self.skip = {} if skip is None else skip  # cells that ended or hung a child: index -> error
        self.errors = list(self.skip.values())
        while True:
            try:
                failed = self._start()
            except BaseException:  # whatever stopped it: the child and its cgroup go too
                self.close()
                raise
            if failed is None:
                return
            self.skip[failed] = self.errors[-1]

    def _start(self) -> int | None:
        """Start a child and load the notebook, less the cells of `self.skip`; the index of a cell
        that killed or hung it."""
        to_child_r, to_child_w = os.pipe()
        to_grader_r, to_grader_w = os.pipe()
        self.home = _child_home()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvlib.course.sandbox", str(to_child_r), str(to_grader_w)],
            pass_fds=(to_child_r, to_grader_w),
            env=_sandbox_env(self.home),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=(os.name == "posix"),
        )
        os.close(to_child_r)
        os.close(to_grader_w)
        self.memory = memory_window(self.process.pid)
        self.channel = Channel(to_grader_r, to_child_w, trusted=False)
        self._fds = (to_grader_r, to_child_w)
        self.deadline = time.monotonic() + self.timeout_s
        package = _package(self.allowed, self.home)
        confine = ("confine", _read_paths(self.folder), self.folder, package)
        memory = getattr(self.memory, "measure", "the child's own figure")  # None: no window
        self.confinement = f"{self.request(confine)[1]}; peak memory: {memory}"
        # guards first (inactive until a graded call runs): whatever the notebook copies or
        # re-imports while it loads is a guarded function already
        self.request(("guard", [], ""))
        # the baseline of a memory window's `held`: the harness, and the libraries the cells
        # import that are the grader's to count (never the notebook's own cells)
        named = [m for m in ("torch", "numpy", "matplotlib.pyplot") if any(
            m.split(".")[0] in cell for cell in self.cells)]  # fmt: skip
        named += ["torch.profiler"] if self.profiled and "torch" in named else []
        self.request(("imports", named))
        with contextlib.suppress(OSError, AttributeError):
            self.memory.baseline = self.memory.usage()
        self.channel.tell(("load", self.cells, sorted(self.skip), self.names))
        for index in [i for i in range(len(self.cells)) if i not in self.skip]:
            try:
                reply = self.channel.reply(self.timeout_s)
            except ChannelTimeout:
                self.close()
                self.errors.append(
                    f"cell {index}: ran longer than {self.timeout_s:g} s while the notebook "
                    "loaded; the grader skipped it"
                )
                return index
            except Unsolicited as exc:
                self.close()
                raise ProcessEnded(f"while the notebook loaded, {exc}") from None
            except ChannelClosed:
                status = self.close()
                self.errors.append(
                    f"cell {index}: ended the Python process (exit status {status}); the grader "
                    "skipped it"
                )
                return index
            if reply[1:2] != (index,) or reply[0] != "cell" or len(reply) != 3:
                self.close()
                raise ProcessEnded("the notebook's process sent something unexpected")
            if reply[2] is not None:
                self.errors.append(str(reply[2])[:MESSAGE_CHARS])
        try:
            self.channel.reply(self.timeout_s)
        except (ChannelTimeout, ChannelClosed):
            self.close()
            raise ProcessEnded("the notebook's process ended after loading") from None
        return None

    def request(self, message, *, compact: bool = False):
        """Send `message`; the child's answer. A child that times out, ends, or sends what was
        not asked for is ended (QuestionTimeout, ProcessEnded)."""
        try:
            wait = max(0.0, self.deadline - time.monotonic())
            return self.channel.request(message, wait, compact=compact)
        except ChannelTimeout:
            self.close()
            raise QuestionTimeout(self.timeout_s) from None
        except Unsolicited as exc:
            self.close()
            raise ProcessEnded(f"{exc}; the grader ended it") from None
        except ChannelClosed:
            status = self.close()
            raise ProcessEnded(
                f"the grading process ended (exit status {status}) before the test finished: "
                "does the notebook call sys.exit, os._exit or crash Python?"
            ) from None

    def close(self):
        """Kill the child's whole process group (threads, grandchildren); its exit status."""
        if self.process is None:
            return None
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        try:
            status = self.process.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            status = None
        if os.name == "posix":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        else:
            self.process.kill()
        self.process.wait()
        self.process = None
        if hasattr(self.memory, "remove"):
            self.memory.remove()
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
            self.home = None
        return status if status is not None else "killed"
