"""Chapter 16's wall-clock measure of speculation in the engine (`kvlib.experiments.spec_engine`):
its rows on a tiny run, its prompts, and the recording's counted columns recomputed
(`make spot-checks`)."""

import csv

import pytest

from kvlib.course.recorded import recorded_file
from kvlib.experiments import spec_engine
from kvlib.loaders.course_model import load_course_model

COUNTED = ("prompt_tokens", "output_tokens", "decode_steps", "decode_tokens", "drafts",
           "draft_tokens", "accepted_tokens", "rejected_drafts", "identical")  # fmt: skip


@pytest.fixture(scope="module")
def course():
    return load_course_model()


def test_course_prompts_are_128_tokens_of_distinct_documents():
    prompts = spec_engine.course_prompts(4)
    assert [len(p) for p in prompts] == [128] * 4
    assert len({tuple(p) for p in prompts}) == 4
    assert spec_engine.course_prompts(1) == prompts[:1]  # a batch extends the smaller one


def test_smollm2_prompts_alternate_the_asks_over_the_essays_sentences():
    class Template:  # what `apply_chat_template` is given, as a list of characters' codes
        def apply_chat_template(self, messages, add_generation_prompt):
            assert add_generation_prompt and messages[0]["role"] == "user"
            return [ord(c) for c in messages[0]["content"]]

    texts = ["".join(map(chr, p)) for p in spec_engine.smollm2_prompts(Template(), 4)]
    assert [t.startswith(spec_engine.ASKS[i % 2]) for i, t in enumerate(texts)] == [True] * 4
    assert texts[0][len(spec_engine.ASKS[0]) :] == texts[1][len(spec_engine.ASKS[1]) :]
    assert texts[0][len(spec_engine.ASKS[0]) :] != texts[2][len(spec_engine.ASKS[0]) :]


def test_a_tiny_comparison_gives_a_plain_and_a_speculative_row(course):
    prompts = spec_engine.course_prompts(2)
    plain, fast = spec_engine.compare(course, prompts, 12, repeats=1)
    assert (plain["engine"], fast["engine"]) == ("plain", "speculative")
    assert plain["identical"] == fast["identical"] == 2  # token-identical, asserted in the run
    assert plain["drafts"] == 0 and fast["drafts"] > 0
    assert 0 < fast["rejected_drafts"] <= fast["drafts"] and plain["rejected_drafts"] == 0
    assert plain["decode_steps"] == 11  # 12 tokens: the prefill samples the first
    assert plain["decode_tokens"] == 2 * 11
    rejected = fast["draft_tokens"] - fast["accepted_tokens"]
    assert fast["decode_tokens"] == plain["decode_tokens"] + rejected
    assert fast["decode_steps"] < plain["decode_steps"]
    assert plain["decode_speedup"] == 1.0
    expected = plain["decode_s"] / fast["decode_s"]
    assert fast["decode_speedup"] == pytest.approx(expected, rel=0.01, abs=1e-3)
    text = spec_engine.table([dict(model="course model", **r) for r in (plain, fast)])
    assert text.count("\n") == 2 and "speculative" in text


@pytest.mark.recorded
def test_recorded_spec_engine_spot_check(course):
    """The course model at 1 and 4 requests again: every counted column equal (greedy decoding
    makes them exact); the timings are not compared (they are this machine's)."""
    recorded = [
        r
        for r in csv.DictReader(open(recorded_file("spec_engine.csv")))
        if r["model"] == "course model" and r["requests"] in ("1", "4")
    ]
    assert len(recorded) == 4, "the recording lacks the course model's rows at 1 and 4 requests"
    for n in (1, 4):
        rows = spec_engine.compare(course, spec_engine.course_prompts(n), 48, repeats=1)
        for new in rows:
            (old,) = [
                r for r in recorded if r["requests"] == str(n) and r["engine"] == new["engine"]
            ]
            assert {c: new[c] for c in COUNTED} == {c: int(old[c]) for c in COUNTED}, (n, old)
