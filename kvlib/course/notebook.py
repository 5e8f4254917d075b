"""Notebook set-up and maintenance: seeding and display defaults, and refreshing stored outputs.

`setup_notebook()` is the first call of every chapter notebook. `python -m kvlib.course.notebook`
(see `execute_in_place`) re-executes notebooks and stores their outputs, which nbval then checks
in CI. Nothing here knows about attention or caches.
"""

from __future__ import annotations

import random

import numpy as np

import kvlib

# Threads for torch's CPU work: the course's models are small (836k and 135M parameters), so more
# threads mostly add synchronisation, and on a many-core GPU machine several notebooks at once with
# one thread per core each oversubscribe the CPU (OpenMP threads spin while they wait).
MAX_TORCH_THREADS = 4


def setup_notebook(seed: int = 0, *, show_devices: bool = False) -> str:
    """Seed python/numpy (and torch if it is installed), fix print and plot defaults, and cap
    torch's CPU threads at `MAX_TORCH_THREADS` (unless `OMP_NUM_THREADS` chooses a count).

    Returns (and the notebooks display) a one-line summary, so the cell has a checked output;
    with `show_devices`, a second line says where the kernel and the models run
    (`kvlib.course.devices.describe`).
    """
    import os

    random.seed(seed)
    np.random.seed(seed)
    np.set_printoptions(precision=4, suppress=True, linewidth=100)
    try:
        import torch
    except ImportError:  # the numpy-only chapters run without torch
        pass
    else:
        torch.manual_seed(seed)
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(min(torch.get_num_threads(), MAX_TORCH_THREADS))
    import matplotlib as mpl

    mpl.rcParams.update(
        {"figure.figsize": (7.0, 4.0), "figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3}
    )
    summary = f"kvlib {kvlib.__version__} ready (seed {seed})"
    if show_devices:
        from kvlib.course.devices import describe

        summary += "\n" + describe()
    return summary


def require_triton(what: str, *, interpret: bool = False) -> None:
    """Stop a Triton chapter's first cell where Triton cannot be imported (macOS, native Windows),
    saying what needs it and that the other chapters run without it. Call it before `import
    triton`: it imports `kvlib.kernels`, which without CUDA sets `TRITON_INTERPRET=1`, and Triton
    reads that when it is first imported.

    With `interpret`, the notebook's kernels run under Triton's interpreter on every machine, a
    GPU machine too (chapter 11's exercises: they are graded under the interpreter, whose
    arithmetic is exact and the same everywhere, on CPU tensors).

    Raises:
        kvlib.kernels.TritonUnavailableError: Triton is not importable here.
        RuntimeError: `interpret`, but Triton was already imported without the interpreter.
    """
    import os
    import sys

    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules or "kvlib.ops.interpreter" in sys.modules:
            raise RuntimeError(
                f"{what}: it runs its kernels under Triton's interpreter, and Triton (or "
                "kvlib.kernels) was imported before this call: restart the kernel and run this "
                "cell first"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    from kvlib.kernels import TritonUnavailableError, triton_available

    if not triton_available():
        raise TritonUnavailableError(
            f"{what}: it needs Linux (on Windows, WSL2) and `pip install triton`; every other "
            "chapter runs without Triton"
        )
    from kvlib.ops.interpreter import INTERPRETED, require_interpretable_triton

    if INTERPRETED:
        require_interpretable_triton()  # and an old Triton's interpreter made to run on NumPy 2.4


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
        for cell in notebook.cells:  # one output per stream, however the kernel chunked it
            if cell.cell_type == "code":
                cell.outputs = _coalesce_streams(cell.outputs)
        nbformat.write(notebook, path)


def _coalesce_streams(outputs: list) -> list:
    """Merge consecutive stdout (or stderr) outputs into one, as nbval does when it compares."""
    merged = []
    for output in outputs:
        previous = merged[-1] if merged else None
        if (
            output.get("output_type") == "stream"
            and previous is not None
            and previous.get("output_type") == "stream"
            and previous.get("name") == output.get("name")
        ):
            previous["text"] = "".join(previous["text"]) + "".join(output["text"])
        else:
            merged.append(output)
    return merged


def run_code_cells(path: str, *, tags: set[str] | None = None) -> int:
    """Run a notebook's code cells in order in this Python process, without Jupyter, and return
    how many ran. IPython magics and shell lines (`%...`, `!...`) are skipped; figures go to the
    non-interactive Agg backend. For machines with Python but no Jupyter (a rented GPU box): it
    checks that the code runs there, not that its outputs match the stored ones (nbval does that).
    With `tags`, only the first code cell (the set-up) and the cells tagged with one of them run
    (e.g. "gpu-recording": the cells that read a GPU recording, run against another one).

    Raises: FileNotFoundError (no such notebook); the first failing cell's exception, with the
        cell's number added to its message notes.
    """
    import json
    import linecache
    import os
    from pathlib import Path

    os.environ.setdefault("MPLBACKEND", "Agg")
    notebook_path = Path(path)
    cells = json.loads(notebook_path.read_text())["cells"]
    namespace = {"__name__": "__main__"}
    previous_dir = Path.cwd()
    os.chdir(notebook_path.parent)  # notebooks resolve relative paths from their own folder
    ran = 0
    try:
        for number, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            if tags is not None and ran and not tags & set(cell["metadata"].get("tags", ())):
                continue
            lines = "".join(cell["source"]).splitlines()
            source = "\n".join(  # a magic becomes `pass`, keeping an enclosing block valid
                line[: len(line) - len(line.lstrip())] + "pass"
                if line.lstrip().startswith(("%", "!"))
                else line
                for line in lines
            )
            filename = f"{notebook_path.name}[cell {number}]"
            # register the source, as IPython does, so inspect (and @triton.jit) can read it
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            try:
                # dont_inherit: this module's `from __future__ import annotations` must not turn
                # the cells' annotations into strings (a kernel's `tl.constexpr` is read as one)
                exec(compile(source, filename, "exec", dont_inherit=True), namespace)
            except Exception as error:
                error.add_note(f"in {notebook_path} cell {number}")
                raise
            ran += 1
    finally:
        os.chdir(previous_dir)
    return ran


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    tags = None
    if args[:1] == ["--plain"] and len(args) > 2 and args[1].startswith("--tags="):
        tags = set(args.pop(1).removeprefix("--tags=").split(","))
    if not args or args == ["--plain"]:
        sys.exit(
            "usage: python -m kvlib.course.notebook NOTEBOOK_OR_FOLDER [...]  (store outputs)\n"
            "       python -m kvlib.course.notebook --plain [--tags=T,...] NOTEBOOK [...]  "
            "(no Jupyter; with --tags, the first code cell and the cells tagged T)"
        )
    if args[0] == "--plain":
        for notebook in args[1:]:
            print(f"{notebook}: {run_code_cells(notebook, tags=tags)} code cells ran")
    else:
        execute_in_place(args)
