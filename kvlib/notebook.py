"""Notebook set-up and maintenance: seeding and display defaults, and refreshing stored outputs.

`setup_notebook()` is the first call of every chapter notebook. `python -m kvlib.notebook`
(see `execute_in_place`) re-executes notebooks and stores their outputs, which nbval then checks
in CI. Nothing here knows about attention or caches.
"""

from __future__ import annotations

import random

import numpy as np

import kvlib


def setup_notebook(seed: int = 0) -> str:
    """Seed python/numpy (and torch if it is installed), fix print and plot defaults.

    Returns (and the notebooks display) a one-line summary, so the cell has a checked output.
    """
    random.seed(seed)
    np.random.seed(seed)
    np.set_printoptions(precision=4, suppress=True, linewidth=100)
    try:
        import torch
    except ImportError:  # the numpy-only chapters run without torch
        pass
    else:
        torch.manual_seed(seed)
    import matplotlib as mpl

    mpl.rcParams.update(
        {"figure.figsize": (7.0, 4.0), "figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3}
    )
    return f"kvlib {kvlib.__version__} ready (seed {seed})"


def execute_in_place(paths: list[str], *, timeout_s: int = 900) -> None:
    """Execute each notebook (or every notebook under each folder) from top to bottom and save it
    with fresh outputs, using nbclient in the notebook's own folder. Raises on the first failing
    cell.
    """
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient
    from tqdm import tqdm

    notebooks = []
    for path in map(Path, paths):
        notebooks.extend(sorted(path.glob("*.ipynb")) if path.is_dir() else [path])
    for path in tqdm(notebooks, desc="executing notebooks", unit="notebook"):
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(
            notebook,
            timeout=timeout_s,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        ).execute()
        nbformat.write(notebook, path)


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python -m kvlib.notebook NOTEBOOK_OR_FOLDER [...]")
    execute_in_place(sys.argv[1:])
