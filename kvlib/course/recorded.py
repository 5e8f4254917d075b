"""Recorded results: finding them, and knowing when the code has changed since they were recorded.

A recorded file (`results/*.csv`, `*.json`) comes from a script that takes longer than a notebook
may, or needs a GPU. `recorded_file(name)` is how a notebook reads one: it finds the file in the
repository's `results/` folder or, outside a clone (Colab, a notebook alone with kvlib installed
from its wheel), in the copy shipped with kvlib as package data (`kvlib._results`); and it prints a
label when the file was recorded with an earlier version of the code that produced it.

Provenance lives in one sidecar, `results/provenance.json`: for each recorded file, the command
that records it, the commit it was recorded at, and the SHA-256 of each source file that produced
it, as that file read when it was recorded. `staleness(name)` compares those hashes with the
sources now; after re-recording a file, `python -m kvlib.course.recorded stamp FILE` stores the
current hashes, `python -m kvlib.course.recorded check` lists every file's state (nonzero exit
when any is stale), and `python -m kvlib.course.recorded relabel notebooks` refreshes the labels
stored in notebooks' outputs after a source changed, without re-executing them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import kvlib

__all__ = [
    "PROVENANCE",
    "Staleness",
    "is_recorded",
    "recorded_file",
    "recorded_dir",
    "source_sha256",
    "staleness",
]

PROVENANCE = "provenance.json"
_PACKAGE_ROOT = Path(kvlib.__file__).resolve().parent.parent  # the repository, or site-packages


def recorded_dir() -> Path:
    """The folder holding the recorded results: the repository's `results/` when kvlib is imported
    from a clone (the files a contributor re-records), else the copy installed with kvlib."""
    repo_results = _PACKAGE_ROOT / "results"
    if (repo_results / PROVENANCE).is_file() and (_PACKAGE_ROOT / "pyproject.toml").is_file():
        return repo_results
    shipped = Path(str(resources.files("kvlib") / "_results"))
    if (shipped / PROVENANCE).is_file():
        return shipped
    raise FileNotFoundError(
        f"no recorded results: neither {repo_results} (a clone of the repository) nor {shipped} "
        "(kvlib installed from its wheel) holds provenance.json"
    )


def source_sha256(data: bytes) -> str:
    """SHA-256 of a source file's bytes, with Windows line endings read as Unix ones (a checkout
    with `core.autocrlf` holds the same source)."""
    return hashlib.sha256(data.replace(b"\r\n", b"\n")).hexdigest()


def _current_sha256(source: str) -> str | None:
    path = _PACKAGE_ROOT / source
    return source_sha256(path.read_bytes()) if path.is_file() else None


def _provenance(folder: Path | None = None) -> dict:
    return json.loads(((folder or recorded_dir()) / PROVENANCE).read_text())


@dataclass(frozen=True)
class Staleness:
    """How a recorded file relates to the current sources: `changed` names the sources whose
    contents differ from when it was recorded (empty: up to date)."""

    name: str
    recorded_at: str
    command: str
    changed: tuple[str, ...]

    @property
    def stale(self) -> bool:
        return bool(self.changed)

    def label(self) -> str:
        if not self.stale:
            return f"results/{self.name}: up to date with its sources"
        return (
            f"recorded with an earlier version: results/{self.name} was recorded at "
            f"{self.recorded_at}, and {', '.join(self.changed)} changed since; "
            f"re-record it with `{self.command}`"
        )


def staleness(name: str, *, folder: Path | None = None) -> Staleness:
    """Compare the source hashes stored for recorded file `name` with the sources kvlib runs now.

    Raises:
        KeyError: `name` has no entry in provenance.json.
    """
    entry = _provenance(folder)[name]
    clone = (_PACKAGE_ROOT / "pyproject.toml").is_file()
    changed = tuple(
        source
        for source, sha in sorted(entry["sources"].items())
        # installed from the wheel, only kvlib's own files are there to compare (a recording's
        # text from book/ is not shipped): the others are checked in a clone
        if (clone or source.startswith("kvlib/")) and _current_sha256(source) != sha
    )
    return Staleness(name, entry["recorded_at"], entry["command"], changed)


RECORDINGS_ENV = "KVLIB_RECORDINGS"  # a folder whose files stand in for the committed ones


def recorded_file(name: str) -> Path:
    """The path of recorded results file `name` (e.g. "serving.csv"), found in the repository's
    `results/` or in kvlib's installed copy. Prints the label "recorded with an earlier version
    ..." when a source that produced it has changed since it was recorded.

    Where the environment variable `KVLIB_RECORDINGS` names a folder holding `name`, that file
    is used instead, and a line says so: a recording made on another GPU (your own, after
    running the experiment with `--out` into that folder) drives the notebook's GPU sections
    in place of the committed one. Its provenance is not checked.
    """
    other = os.environ.get(RECORDINGS_ENV)
    if other and (Path(other) / name).is_file():
        print(f"{name}: the recording in {RECORDINGS_ENV}={other}, not the committed one")
        return Path(other) / name
    folder = recorded_dir()
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"no recorded results file {name!r} in {folder}")
    state = staleness(name, folder=folder)
    if state.stale:
        print(state.label())
    return path


def is_recorded(name: str) -> bool:
    """Whether recorded results file `name` is there for `recorded_file` to read (in
    `KVLIB_RECORDINGS`, the repository's `results/` or kvlib's installed copy). A GPU result not
    recorded yet is absent: a notebook then shows what it can measure instead, and says so."""
    other = os.environ.get(RECORDINGS_ENV)
    return bool(other and (Path(other) / name).is_file()) or (recorded_dir() / name).is_file()


def stamp(name: str, *, commit: str | None = None) -> dict:
    """Store the current hashes of `name`'s sources in results/provenance.json (run after
    re-recording it), with `commit` (default: the repository's HEAD) as where it was recorded.

    A file recorded for the first time has no entry yet: it gets one from the experiment that
    writes it, `kvlib.experiments.<the file's stem>`, whose `PROVENANCE_SOURCES` lists its
    sources (the command is `python -m` that module).

    Raises:
        KeyError: no entry, and no such experiment or no `PROVENANCE_SOURCES` in it.
    """
    import importlib

    folder = _PACKAGE_ROOT / "results"
    table = _provenance(folder)
    if name not in table:
        module = f"kvlib.experiments.{Path(name).stem}"
        try:
            sources = importlib.import_module(module).PROVENANCE_SOURCES
        except (ImportError, AttributeError):
            raise KeyError(
                f"{name}: no entry in {PROVENANCE}, and {module} has no PROVENANCE_SOURCES "
                "to start one from"
            ) from None
        table[name] = {"command": f"python -m {module}", "sources": dict.fromkeys(sources)}
    entry = table[name]
    if commit is None:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=_PACKAGE_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    entry["recorded_at"] = commit
    entry["sources"] = {source: _current_sha256(source) for source in sorted(entry["sources"])}
    (folder / PROVENANCE).write_text(json.dumps(table, indent=2) + "\n")
    return entry


_LABEL_START = "recorded with an earlier version: results/"


def relabel(path: Path) -> list[str]:
    """Bring the labels in notebook `path`'s stored outputs up to date without re-executing it:
    in each cell that calls `recorded_file("NAME")`, a label line of NAME is replaced by the
    current label, or removed when NAME is up to date. Returns what could not be done this way
    (a file newly stale, whose label has no line to replace yet: re-execute that notebook)."""
    import re

    import nbformat

    notebook = nbformat.read(path, as_version=4)
    todo, changed = [], False
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        for name in re.findall(r'recorded_file\("([^"]+)"\)', cell.source):
            if not is_recorded(name):  # not recorded yet (a GPU result): no label to show
                continue
            state, prefix, found = staleness(name), f"{_LABEL_START}{name} ", False
            for output in cell.outputs:
                if output.output_type != "stream":
                    continue
                lines = output.text.splitlines(keepends=True)
                new = [
                    (state.label() + "\n" if state.stale else "")
                    if line.startswith(prefix)
                    else line
                    for line in lines
                ]
                found = found or any(line.startswith(prefix) for line in lines)
                if new != lines:
                    output.text, changed = "".join(new), True
            if state.stale and not found:
                todo.append(f"{path} (cell {index}): {name} is newly stale; re-execute it")
        cell.outputs = [o for o in cell.outputs if o.output_type != "stream" or o.text]
    if changed:
        nbformat.write(notebook, path)
    return todo


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvlib.course.recorded", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="list each recorded file's state; exit 1 when any is stale")
    stamp_parser = sub.add_parser("stamp", help="store FILE's current source hashes")
    stamp_parser.add_argument("files", nargs="+", help="results files, e.g. results/serving.csv")
    relabel_parser = sub.add_parser("relabel", help="refresh the labels in notebooks' outputs")
    relabel_parser.add_argument("paths", nargs="+", help="notebooks, or folders of notebooks")
    args = parser.parse_args(argv)
    if args.command == "relabel":
        todo = []
        for path in map(Path, args.paths):
            for notebook in sorted(path.glob("*.ipynb")) if path.is_dir() else [path]:
                todo += relabel(notebook)
        print("\n".join(todo) or "labels up to date")
        return int(bool(todo))
    if args.command == "stamp":
        for file in args.files:
            stamp(Path(file).name)
            print(f"stamped {Path(file).name}")
        return 0
    states = [staleness(name) for name in sorted(_provenance())]
    for state in states:
        print(state.label())
    return int(any(state.stale for state in states))


if __name__ == "__main__":
    sys.exit(main())
