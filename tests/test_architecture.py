"""kvlib's three layers (book/architecture.md): the library, the experiments (`kvlib.experiments`)
and the course machinery (`kvlib.course`). Every import of every module, top-level or lazy (inside
a function), is an arrow; arrows point down only (course -> experiments -> library), the graph
has no cycle, and every module reads in one sitting (at most 400 non-blank lines)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KVLIB = ROOT / "kvlib"
MAX_LINES = 400
LAYERS = {"library": 0, "experiments": 1, "course": 2}  # an arrow may not point to a higher number


def module_name(path: Path) -> str:
    parts = path.relative_to(KVLIB.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    if module == "kvlib.course" or module.startswith("kvlib.course."):
        return "course"
    if module == "kvlib.experiments" or module.startswith("kvlib.experiments."):
        return "experiments"
    return "library"


def imported_modules(source: str, module: str, known: set[str]) -> set[str]:
    """The kvlib modules that `source` (module `module`) imports anywhere: `import a.b`,
    `from a.b import c` (c itself when it is a module), relative imports, inside functions too."""
    found = set()
    package = (
        module if module in {m.rsplit(".", 1)[0] for m in known} else module.rpartition(".")[0]
    )
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name in known:
                found.add(name)
    found.discard(module)
    return found


def import_graph(root: Path = KVLIB) -> dict[str, set[str]]:
    """{module: the kvlib modules it imports}, over every .py file under `root`."""
    files = {module_name(p): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    return {m: imported_modules(p.read_text(), m, known) for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} ({layer_of(a)}) -> {b} ({layer_of(b)})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if LAYERS[layer_of(b)] > LAYERS[layer_of(a)]
    ]


def test_a_planted_cycle_is_found_and_printed():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) is None
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


def test_lazy_and_relative_imports_are_arrows(tmp_path):
    package = tmp_path / "kvlib"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("def f():\n    from kvlib.sub import b\n")
    (package / "sub" / "b.py").write_text("from . import c\n")
    (package / "sub" / "c.py").write_text("import kvlib.sub.a\n")
    files = {module_name_in(p, tmp_path): p for p in package.rglob("*.py")}
    graph = {m: imported_modules(p.read_text(), m, set(files)) for m, p in files.items()}
    assert graph["kvlib.sub.a"] == {"kvlib.sub", "kvlib.sub.b"}
    assert graph["kvlib.sub.b"] == {"kvlib.sub", "kvlib.sub.c"}
    assert find_cycle(graph) == ["kvlib.sub.a", "kvlib.sub.b", "kvlib.sub.c", "kvlib.sub.a"]


def module_name_in(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_an_upward_arrow_is_reported():
    graph = {"kvlib.model": {"kvlib.experiments.serving"}, "kvlib.experiments.serving": set()}
    assert upward_arrows(graph) == [
        "kvlib.model (library) -> kvlib.experiments.serving (experiments)"
    ]
    assert upward_arrows({"kvlib.course.viz": {"kvlib.experiments.serving", "kvlib.model"}}) == []


def test_kvlib_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kvlib_imports_point_down_the_layers():
    arrows = upward_arrows(import_graph())
    assert not arrows, "upward imports:\n" + "\n".join(arrows)


def test_the_three_layers_exist():
    layers = {layer_of(m) for m in import_graph()}
    assert layers == set(LAYERS)


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(KVLIB.parent).as_posix() for p in KVLIB.rglob("*.py"))
)
def test_every_module_reads_in_one_sitting(path):
    lines = [line for line in (KVLIB.parent / path).read_text().splitlines() if line.strip()]
    assert len(lines) <= MAX_LINES, f"{path}: {len(lines)} non-blank lines > {MAX_LINES}"


def test_an_experiments_command_line_writes_where_asked_and_says_what_it_wrote(tmp_path, capsys):
    from kvlib.experiments.cli import run

    out = str(tmp_path / "rows.csv")
    for record, said in [
        (lambda path: [{"a": 1}, {"a": 2}], f"wrote 2 rows to {out}"),
        (lambda path: "3 trials, 2 correct", "3 trials, 2 correct"),
        (lambda path: {"variants": []}, f"wrote {out}"),
    ]:
        written = []
        assert (
            run(
                "x",
                "help",
                "results/x.csv",
                lambda p: written.append(p) or record(p),
                ["--out", out],
            )
            == 0
        )
        assert written == [out]
        assert capsys.readouterr().out == said + "\n"


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebooks_first_cell_is_its_imports_and_set_up_in_at_most_15_lines(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "code")
    lines = [line for line in "".join(first["source"]).splitlines() if line.strip()]
    assert len(lines) <= 15, f"{notebook.name}'s first code cell has {len(lines)} lines"
    assert any("setup_notebook(" in line for line in lines), notebook.name
