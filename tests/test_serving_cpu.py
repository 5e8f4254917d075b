"""Chapter 12's CPU comparison with transformers (`kvlib.experiments.serving_cpu`): its rows on a
tiny run, and the recording's counted columns recomputed (`make spot-checks`)."""

import csv

import pytest

from kvlib.course.recorded import recorded_file
from kvlib.experiments import serving_cpu
from kvlib.loaders.course_model import load_course_model


@pytest.fixture(scope="module")
def course():
    return load_course_model()


def test_prompts_use_the_whole_small_vocabulary_and_the_lengths(course):
    prompts = serving_cpu.prompts_for(course, 64)
    lengths = [len(p) for p in prompts]
    assert min(lengths) >= 32 and max(lengths) <= 96
    assert max(max(p) for p in prompts) < course.config.vocab_size
    assert prompts == serving_cpu.prompts_for(course, 64)  # seeded


def test_a_quick_comparison_gives_a_row_per_contender(course):
    rows = serving_cpu.compare(course, 3, max_tokens=4, repeats=1, quick=True)
    assert [r["contender"] for r in rows] == ["kvlib_engine", "hf_generate"]
    ours, theirs = rows
    assert ours["identical_to_kvlib"] == 3 and ours["output_tokens"] == 12
    assert theirs["speedup_vs_hf_generate"] == 1.0
    # (the seconds are rounded to the millisecond: a tiny run's ratio of them only roughly)
    assert ours["speedup_vs_hf_generate"] == pytest.approx(theirs["best_s"] / ours["best_s"], 0.1)
    text = serving_cpu.table([dict(model="course", **r) for r in rows])
    assert "kvlib_engine" in text and text.count("\n") == 2


@pytest.mark.recorded
def test_recorded_serving_cpu_spot_check(course):
    """The course model's run at 16 requests again: the same prompt and output token counts,
    and each contender's requests equal to the engine's within one of the recorded count (float32
    in another operation order on another CPU may flip one near-tie); the timings are not
    compared (they are this machine's)."""
    recorded = [
        r
        for r in csv.DictReader(open(recorded_file("serving_cpu.csv")))
        if r["model"] == "course" and r["requests"] == "16"
    ]
    assert recorded, "no course-model row at 16 requests in the recording"
    rows = {r["contender"]: r for r in serving_cpu.compare(course, 16, repeats=1)}
    for old in recorded:
        new = rows[old["contender"]]
        assert new["prompt_tokens"] == int(old["prompt_tokens"])
        assert new["output_tokens"] == int(old["output_tokens"])
        assert abs(new["identical_to_kvlib"] - int(old["identical_to_kvlib"])) <= 1, old
