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


# --- composition, not reach-through (issue 58) ----------------------------------------------------

NAMEDTUPLE_METHODS = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
BASE_MODULES = {"kvlib._validate", "kvlib.errors"}  # what kvlib.ops may import besides itself


def class_private_names(tree: ast.AST) -> set[str]:
    """Underscored attributes a module's classes define: methods and class attributes in a class
    body, and `self._x = ...` assignments in its methods."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                if any(node in ast.walk(stmt) for stmt in cls.body if isinstance(stmt, ast.Assign)):
                    names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reads(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, expression, attribute) for each `other._x` in a module: an underscored attribute
    read on anything but `self`, `cls` or `super()` (NamedTuple's `_replace` and kin are
    public API)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") or node.attr in NAMEDTUPLE_METHODS:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
            continue
        found.append((node.lineno, ast.unparse(node), node.attr))
    return found


def cross_module_private_reads(root: Path = KVLIB) -> list[str]:
    """`path:line: expr` for each read of an underscored attribute that a class of ANOTHER kvlib
    module defines (a module's own classes may share their private state among themselves)."""
    trees = {p: ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))}
    owners: dict[str, set[Path]] = {}
    for path, tree in trees.items():
        for name in class_private_names(tree):
            owners.setdefault(name, set()).add(path)
    problems = []
    for path, tree in trees.items():
        for line, expr, attr in private_reads(tree):
            if attr in owners and path not in owners[attr]:
                problems.append(f"{path.relative_to(root.parent)}:{line}: {expr}")
    return problems


def test_a_planted_private_read_across_modules_is_found(tmp_path):
    (tmp_path / "kvlib").mkdir()
    (tmp_path / "kvlib" / "a.py").write_text(
        "class A:\n    def __init__(self):\n        self._state = 1\n    def _hook(self):\n"
        "        return self._state\n"
    )
    (tmp_path / "kvlib" / "b.py").write_text(
        "def f(a, kv):\n    return a._state, a._hook(), kv._replace(x=1), a.state\n"
    )
    (tmp_path / "kvlib" / "c.py").write_text(
        "class C:\n    def same(self, other):\n        return other._own\n"
        "    def __init__(self):\n        self._own = 0\n"
    )
    assert cross_module_private_reads(tmp_path / "kvlib") == [
        "kvlib/b.py:2: a._state",
        "kvlib/b.py:2: a._hook",
    ]


def test_no_kvlib_module_reads_another_modules_private_attributes():
    assert cross_module_private_reads() == []


def test_the_engine_is_composed_not_mixed():
    """`LLMEngine` holds its parts (scheduler, block manager, runner, statistics): no base class
    mixes behaviour in that reaches into its attributes."""
    from kvlib.engine import LLMEngine

    assert LLMEngine.__bases__ == (object,)


def test_kvlib_ops_imports_only_itself_and_the_base_modules():
    """The kernels' layer sits below everything that launches them (kvlib.kernels, the engine):
    nothing in kvlib.ops imports upward."""
    graph = import_graph()
    upward = {
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.startswith("kvlib.ops")
        for target in targets
        if not (target.startswith("kvlib.ops") or target in BASE_MODULES)
    }
    assert not upward, sorted(upward)
