"""The notebook helpers of kvlib.course.notebook: stream coalescing and the Jupyter-free runner."""

import json

import pytest

from kvlib.course.notebook import _coalesce_streams, run_code_cells


def test_consecutive_streams_of_one_name_merge_and_others_stay_apart():
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": "a\n"},
        {"output_type": "stream", "name": "stdout", "text": ["b", "\n"]},
        {"output_type": "stream", "name": "stderr", "text": "warn\n"},
        {"output_type": "execute_result", "data": {"text/plain": "1"}},
        {"output_type": "stream", "name": "stdout", "text": "c\n"},
    ]
    merged = _coalesce_streams(outputs)
    assert [o.get("text") for o in merged] == ["a\nb\n", "warn\n", None, "c\n"]


def test_run_code_cells_skips_magics_keeps_blocks_valid_and_names_the_failing_cell(tmp_path):
    def notebook(*sources):
        cells = [{"cell_type": "markdown", "metadata": {}, "source": "# title"}]
        cells += [
            {
                "cell_type": "code",
                "metadata": {},
                "source": s,
                "outputs": [],
                "execution_count": None,
            }
            for s in sources
        ]
        path = tmp_path / "n.ipynb"
        path.write_text(
            json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
        )
        return path

    ok = notebook("import sys\nif False:\n    %pip install nothing\nx = 2", "assert x == 2\n!ls")
    assert run_code_cells(str(ok)) == 2
    broken = notebook("y = 1", "assert y == 2, 'y is not 2'")
    with pytest.raises(AssertionError, match="y is not 2") as error:
        run_code_cells(str(broken))
    assert any("cell 2" in note for note in error.value.__notes__)


def test_require_triton_stops_a_triton_chapter_with_what_needs_it_and_what_runs_without(
    monkeypatch,
):
    import kvlib.kernels as K
    from kvlib.course.notebook import require_triton

    if K.triton_available():
        assert require_triton("chapter 11") is None  # where Triton imports, nothing happens
    monkeypatch.setattr(K, "triton_available", lambda: False)
    with pytest.raises(K.TritonUnavailableError) as raised:
        require_triton("chapter 11 writes and launches Triton kernels")
    assert str(raised.value).startswith("chapter 11 writes and launches Triton kernels: it needs")
    for needed in ("Linux", "WSL2", "pip install triton", "every other chapter runs without"):
        assert needed in str(raised.value), needed


def test_require_triton_with_interpret_sets_the_interpreter_first_or_says_to_restart():
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "from kvlib.course.notebook import require_triton\n"
        "if sys.argv[1] == 'late':\n"
        "    sys.modules['triton'] = object()  # as if Triton were imported, compiled\n"
        "try:\n"
        "    require_triton('chapter 11', interpret=True)\n"
        "except RuntimeError as error:\n"
        "    print('refused:', error)\n"
        "print('TRITON_INTERPRET =', os.environ.get('TRITON_INTERPRET'))\n"
    )
    first = subprocess.run([sys.executable, "-c", script, "first"], capture_output=True, text=True)
    assert first.stdout.strip().splitlines() == ["TRITON_INTERPRET = 1"], first.stderr
    late = subprocess.run([sys.executable, "-c", script, "late"], capture_output=True, text=True)
    assert "refused: chapter 11: it runs its kernels under Triton's interpreter" in late.stdout
    assert "restart the kernel" in late.stdout and "TRITON_INTERPRET = None" in late.stdout


def test_operator_time_share_counts_the_named_operators_and_prints_nothing(capfd):
    import torch

    from kvlib.course.bench import operator_time_share

    a = torch.ones(256, 256)
    share = operator_time_share(lambda: (a @ a).sum(), ("aten::mm",))
    assert 0 < share <= 1
    assert operator_time_share(lambda: (a @ a).sum(), ("aten::no_such_op",)) == 0
    assert capfd.readouterr().err == ""  # the profiler's timestamped lines silenced
    with pytest.raises(TypeError, match="fn: expected a callable"):
        operator_time_share(3, ("aten::mm",))
