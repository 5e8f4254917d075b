"""A pytest plugin that records each notebook's nbval time into a CSV file (issue 54): the run times
each chapter states at its top (`python -m kvlib.course.path`) are measured, not guessed.

`make chapter-times` runs nbval on the chapters with `-p tests.notebook_times
--record-notebook-times book/chapter_times.csv`; tests/test_book_path.py checks that every chapter
states the time its recorded seconds give."""

from __future__ import annotations

import csv
import os
import platform
import time
from collections import defaultdict
from pathlib import Path

_seconds: dict[str, float] = defaultdict(float)
_failed: set[str] = set()


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--record-notebook-times",
        metavar="PATH",
        default=None,
        help="write each notebook's seconds (the sum of its cells') to this CSV file",
    )


def pytest_runtest_logreport(report) -> None:
    path = Path(report.nodeid.split("::")[0])
    if path.suffix == ".ipynb":
        _seconds[path.as_posix()] += report.duration
        if report.failed:
            _failed.add(path.as_posix())


def pytest_sessionfinish(session, exitstatus) -> None:
    out = session.config.getoption("--record-notebook-times")
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller writes
        return
    if not out or not _seconds:
        return
    workers = getattr(session.config.option, "numprocesses", None) or 1
    rows = [
        {
            "notebook": path,
            "seconds": f"{seconds:.1f}",
            "passed": path not in _failed,
            "cpu_cores": os.cpu_count(),
            "notebooks_at_a_time": workers,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
            "machine": platform.machine(),
            "load_average_1min": f"{os.getloadavg()[0]:.1f}",  # other programs on the machine
            "recorded_at": time.strftime("%Y-%m-%d", time.gmtime()),
        }
        for path, seconds in sorted(_seconds.items())
    ]
    with open(out, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
