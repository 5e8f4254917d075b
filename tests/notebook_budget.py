"""A pytest plugin for `make nbval`: each notebook's execution time against its budget.

COURSE.md: a chapter notebook runs in about 60 s on 2 CPU cores, a solution notebook in far less.
The summary lists every notebook's time; one over its budget is flagged, and one over three times
its budget fails the run (a chapter that has grown a sweep belongs in a script with a committed
results file instead).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

BUDGET_S = {"notebooks": 60.0, "solutions": 20.0}
HARD_LIMIT = 3.0  # times the budget

_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    path = Path(report.nodeid.split("::")[0])
    if path.suffix == ".ipynb":
        _seconds[str(path)] += report.duration


def _budget(path: str) -> float:
    return BUDGET_S.get(Path(path).parent.name, 60.0)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    workers = getattr(terminalreporter.config.option, "numprocesses", None)  # pytest-xdist's -n
    how = f"{workers} notebooks at a time" if workers and workers != 1 else "one at a time"
    terminalreporter.section(f"notebook time against budget (2 CPU cores, {how})")
    for path, seconds in sorted(_seconds.items()):
        budget = _budget(path)
        verdict = "ok" if seconds <= budget else f"OVER BUDGET ({seconds / budget:.1f}x)"
        line = f"{seconds:7.1f} s  budget {budget:4.0f} s  {verdict:<20} {path}"
        terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus) -> None:
    over = [p for p, s in _seconds.items() if s > HARD_LIMIT * _budget(p)]
    if over and exitstatus == 0:
        print(f"\nnotebooks over {HARD_LIMIT:g}x their time budget: {', '.join(sorted(over))}")
        session.exitstatus = 1
