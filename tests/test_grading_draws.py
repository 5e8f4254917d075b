"""Every solution's function against its question's random cases, 500 draws per question (issue
47): a random case must never fail the official solution. The draws run in this process (the
sandbox's own request handler, called directly: no child process and no guards), so that they stay
cheap; the fixed cases and the measured checks are left to tests/test_grading.py."""

import linecache
import pickle
from pathlib import Path

import pytest

from kvlib.course.grader import read_code_cells
from kvlib.course.grading import chapter_of, chapter_questions, run_question
from kvlib.course.sandbox import _cell_code, handle_request

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
DRAWS = 500


class LocalSide:
    """The learner's side in this process: the sandbox's request handler, called directly."""

    pid = None

    def __init__(self, namespace: dict):
        self.namespace = namespace

    def request(self, message):
        if message[0] == "guard":  # no guards here: the solutions call no kvlib function
            return ("guarded",)
        return handle_request(message, self.namespace)

    def call_direct(self, message, answer):
        message = pickle.loads(pickle.dumps(message))  # by value, as over the pipe
        return handle_request(message, self.namespace, answer)


def solution_namespace(path: Path, monkeypatch) -> dict:
    """The solution notebook's definitions, its cells executed here (check() and show() silent)."""
    monkeypatch.setenv("KVLIB_GRADING", "1")
    namespace: dict = {"__name__": "__main__"}
    for index, source in enumerate(read_code_cells(path)):
        text, filename = _cell_code(source), f"<{path.name} cell {index}>"
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        exec(compile(text, filename, "exec"), namespace)
    return namespace


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name[:2])
def test_solutions_pass_every_random_case(path, monkeypatch):
    if path.name.startswith("11_"):
        from kvlib.kernels import triton_available  # sets TRITON_INTERPRET before Triton loads

        if not triton_available():
            pytest.skip("chapter 11's kernels need Triton")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread, no pool to wake for each operator
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # a notebook's set-up cell
    side = LocalSide(solution_namespace(path, monkeypatch))
    failures = []
    for q in chapter_questions(chapter_of(path)):
        for seed in range(DRAWS):
            passed, message = run_question(q, side, [], seed, draws_only=True)
            if not passed:
                failures.append(f"{q.id}, seed {seed}: {message}")
    monkeypatch.undo()
    torch.set_num_threads(threads)
    assert not failures, f"{len(failures)} failing draws; the first: {failures[:3]}"
