"""A path through the course (issue 54): each chapter opens with its prerequisites, the time
to read it (from its word count) and to run it (from the nbval times recorded in
book/chapter_times.csv by `make chapter-times`), and what the learner can do after it, exactly as
kvlib.course.path generates them; it ends with a recap; and the landing page's map is the one
drawn from the same prerequisites."""

import csv
import json
import math
from pathlib import Path

import pytest

from kvlib.course import path as P

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = range(1, 16)


def first_markdown(number: int) -> str:
    cells = json.loads(P.notebook_path(number).read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])


@pytest.mark.parametrize("number", CHAPTERS)
def test_each_chapter_states_its_path_as_generated(number):
    text = first_markdown(number)
    assert P.chapter_header(number) in text, (
        f"chapter {number}'s header is out of date: python -m kvlib.course.path write"
    )
    assert text.index(P.START) < 200  # at the top, under the title


def test_the_stated_times_come_from_the_recorded_times():
    with open(P.TIMES, newline="") as file:
        rows = {row["notebook"]: row for row in csv.DictReader(file)}
    for number in CHAPTERS:
        key = f"notebooks/{P.notebook_path(number).name}"
        assert key in rows, f"{key}: no recorded time (make chapter-times)"
        assert rows[key]["passed"] == "True", f"{key}: recorded from a failing run"
        minutes = max(1, math.ceil(float(rows[key]["seconds"]) / 60))
        words = P.prose_words(P.notebook_path(number))
        reading = max(5, 5 * round(words / 200 / 5))
        stated = f"**Reading:** about {reading} min. **Running:** about {minutes} min on 2 CPU"
        assert stated in first_markdown(number), (number, stated)


def test_prerequisites_point_back_and_each_chapter_ends_with_a_recap():
    for number, chapter in P.CHAPTERS.items():
        assert all(0 < p < number for p in chapter.prerequisites), chapter
    for number in CHAPTERS:
        cells = json.loads(P.notebook_path(number).read_text())["cells"]
        text = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        assert "## What to remember" in text or "## Summary" in text, number


def test_the_map_is_drawn_from_the_prerequisites(tmp_path):
    out = tmp_path / "map.svg"
    P.draw_chapter_map(out)
    assert out.read_bytes() == P.MAP.read_bytes(), "python -m kvlib.course.path write"
    svg = out.read_text()
    for number, chapter in P.CHAPTERS.items():
        assert f"{number}. {chapter.short}" in svg
    assert P.direct_prerequisites(14) == (12,)  # 7 is implied through 12


def test_reading_time_follows_the_word_count(tmp_path):
    notebook = {"cells": [{"cell_type": "markdown", "source": ["word " * 2000]}]}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(notebook))
    assert P.prose_words(path) == 2000 and P.reading_minutes(path) == 10
