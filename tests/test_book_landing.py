"""The landing page's recorded-results table (book/intro.md, "CPU or GPU?") is the one generated
from results/ (kvlib.course.landing), so it names the machine that recorded each file (issue 54)."""

import csv
from pathlib import Path

import pytest

from kvlib.course import landing

ROOT = Path(__file__).resolve().parent.parent


def test_the_intro_table_is_generated_from_results():
    page = (ROOT / "book" / "intro.md").read_text()
    start = page.index(landing.START) + len(landing.START)
    table = page[start : page.index(landing.END)].strip()
    assert table == landing.recorded_table(), "run: python -m kvlib.course.landing write"


def test_every_recorded_file_has_a_row_naming_its_gpu():
    table = landing.recorded_table()
    recorded = {p.name for p in (ROOT / "results").iterdir() if p.suffix in (".csv", ".json")} - {
        "provenance.json"
    }
    assert set(landing.WHAT) == recorded  # no description left for a file that is gone
    for name in recorded:
        (row,) = [line for line in table.splitlines() if f"`{name}`" in line]
        if name.endswith(".csv"):
            with open(ROOT / "results" / name, newline="") as file:
                devices = {r.get("device", "") for r in csv.DictReader(file)}
            for gpu in (d for d in devices if d.startswith("NVIDIA")):
                assert gpu in row, (name, row)
    # the machines as the files say, not as prose once said
    assert "NVIDIA H200" in table


def test_the_table_follows_a_changed_results_folder(tmp_path):
    (tmp_path / "decode_bench.csv").write_text("device,date\nNVIDIA B200,2027-01-02\n")
    (tmp_path / "provenance.json").write_text("{}")
    table = landing.recorded_table(tmp_path, ROOT / "notebooks")
    assert "| `decode_bench.csv` |" in table and "NVIDIA B200 | 2027-01-02 | 7, 11" in table
    (tmp_path / "new_result.csv").write_text("a\n1\n")
    with pytest.raises(KeyError, match="results/new_result.csv: no entry"):
        landing.recorded_table(tmp_path, ROOT / "notebooks")
