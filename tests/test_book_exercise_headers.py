"""The exercise notebooks open with what a learner needs (how to check, how to grade, the rules in
one short list), not the grader's sandbox internals (issue 54); those are on the instructors'
page (book/grader_guarantees.md)."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "exercises").glob("*.ipynb")) + sorted(
    (ROOT / "solutions").glob("*.ipynb")
)
# the sandbox's machinery, which a learner does not need to read before starting
INTERNALS = re.compile(
    r"subprocess|ctypes|os\.system|multiprocessing|\bfork\b|\bexec\b|seccomp|unprivileged|"
    r"\bnobody\b|\bas root\b|sandbox|fresh process|child process|peak (resident )?memory",
    re.I,
)


def header(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_exercise_header_is_for_learners(path):
    text = header(path)
    found = sorted({m.group(0).lower() for m in INTERNALS.finditer(text)})
    assert not found, f"{path.name}'s header names the sandbox's internals: {found}"
    assert f"kvlib.course.grade exercises/{path.name}" in text  # how to grade
    assert "check(" in text  # how to check


def test_the_detector_catches_yesterdays_header():
    old = "* without creating processes (`subprocess`, `ctypes`), as an unprivileged user"
    assert {m.group(0) for m in INTERNALS.finditer(old)} == {"subprocess", "ctypes", "unprivileged"}
