"""Chapters 7, 11 and 12's GPU sections work from any GPU's recording (issue 51): their cells that
read a recording (tagged `gpu-recording`) run against the committed one and against the H100 and
H200 recordings kept in tests/fixtures/recordings/ (through `KVLIB_RECORDINGS`), and chapter 11's
live branch runs on the CPU with `KVLIB_GPU_BRANCHES=cpu`. Every GPU-only branch of a notebook is
listed here, with how CI runs it on a CPU (`make gpu-branches`) or why it cannot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "recordings"
# the notebooks with GPU sections, and the recordings each reads
GPU_SECTIONS = {
    "notebooks/07_paged_cache.ipynb": {"decode_bench.csv"},
    "notebooks/11_triton_decode.ipynb": {"decode_bench.csv"},
    "notebooks/12_serving_engine.ipynb": {"serving_gpu.csv"},
}
# (notebook, recording folder): every fixture recording against every notebook that reads it
CASES = [
    (notebook, folder.name)
    for notebook, reads in GPU_SECTIONS.items()
    for folder in sorted(FIXTURES.iterdir())
    if any((folder / name).is_file() for name in reads)
]

# Notebooks whose code branches on a GPU (`gpu_branches()`, `torch.cuda.is_available()`): each is
# run on the CPU by `make gpu-branches` (KVLIB_GPU_BRANCHES=cpu), or listed in CPU_UNREACHABLE.
GPU_BRANCH_NOTEBOOKS = ["notebooks/11_triton_decode.ipynb", "notebooks/15_sparse_attention.ipynb"]
CPU_UNREACHABLE: dict[str, str] = {}  # notebook -> why its GPU branch cannot run on a CPU


def run_tagged(notebook: str, **env) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlib.course.notebook",
            "--plain",
            "--tags=gpu-recording",
            notebook,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "MPLBACKEND": "Agg", **env},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize(("notebook", "recording"), CASES, ids=lambda v: Path(v).stem)
def test_gpu_sections_run_on_another_gpus_recording(notebook, recording):
    folder = FIXTURES / recording
    out = run_tagged(notebook, KVLIB_RECORDINGS=str(folder))
    for name in GPU_SECTIONS[notebook]:
        if (folder / name).is_file():
            assert f"{name}: the recording in KVLIB_RECORDINGS={folder}" in out
    assert "code cells ran" in out


@pytest.mark.parametrize("notebook", GPU_SECTIONS, ids=lambda p: Path(p).stem)
def test_gpu_sections_run_on_the_committed_recording(notebook):
    out = run_tagged(notebook, KVLIB_RECORDINGS="")
    assert "recorded on" in out or "recorded 20" in out


def test_chapter_11s_live_branch_runs_on_the_cpu_with_tiny_shapes():
    out = run_tagged(GPU_BRANCH_NOTEBOOKS[0], KVLIB_GPU_BRANCHES="cpu")
    assert "measured live on CPU (Triton interpreter)" in out
    assert "no such case in these rows" in out  # the targets' groups are empty, and reported


def test_chapter_15s_gpu_section_runs_live_on_the_cpu_and_without_a_recording():
    """Chapter 15's sparse benchmark: its live branch on the CPU with tiny shapes, and, with no
    results/sparse_bench.csv recorded yet, the interpreter's measurement, labelled as such."""
    from kvlib.course.recorded import is_recorded

    live = run_tagged(GPU_BRANCH_NOTEBOOKS[1], KVLIB_GPU_BRANCHES="cpu")
    assert "measured live on CPU (Triton interpreter)" in live
    out = run_tagged(GPU_BRANCH_NOTEBOOKS[1], KVLIB_RECORDINGS="")
    if is_recorded("sparse_bench.csv"):
        assert "recorded on" in out
    else:
        assert "no GPU result recorded yet: Triton's CPU interpreter (NOT GPU times)" in out


def test_every_gpu_branch_is_run_on_the_cpu_or_says_why_not():
    branching = []
    for path in sorted(ROOT.glob("*/*.ipynb")):
        if path.parent.name not in ("notebooks", "exercises", "solutions"):
            continue
        cells = json.loads(path.read_text())["cells"]
        code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        if "gpu_branches()" in code or "torch.cuda.is_available()" in code:
            branching.append(str(path.relative_to(ROOT)))
    assert sorted(branching) == sorted(GPU_BRANCH_NOTEBOOKS + list(CPU_UNREACHABLE))
    makefile = (ROOT / "Makefile").read_text()
    for notebook in GPU_BRANCH_NOTEBOOKS:
        assert notebook in makefile  # `make gpu-branches` runs it
