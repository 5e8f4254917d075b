"""`n > 1` (parallel sampling) within `--max-num-seqs` (issue 56, 7): the forked choices of one
request used to skip the limit (6 running with a limit of 2). Through the engine, and through a
started server with httpx."""

from __future__ import annotations

import httpx
import pytest

from kvlib.engine import LLMEngine, SamplingParams
from kvlib.loaders.course_model import load_course_model
from kvlib.serve.models import CourseTokenizer, ServedModel
from kvlib.serve.server import ServerThread, create_app

PROMPT = "BOS SET k1 v2 SET k3 v4 w5 w6 w7 GET k1"
ENGINE = dict(num_blocks=64, block_size=4, max_num_batched_tokens=256, max_model_len=128)


@pytest.fixture(scope="module")
def model():
    return load_course_model()


def run(engine, ids, params):
    outputs = {}
    engine.add_parallel_requests([f"c{i}" for i in range(len(params))], ids, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert len(engine.scheduler.running) <= engine.config.max_num_seqs
        engine.manager.check_invariants()
    return outputs


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3])
def test_forked_choices_respect_max_num_seqs_and_sample_what_they_sample_alone(model, max_num_seqs):
    ids = CourseTokenizer().encode(PROMPT)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8) for s in range(5)]
    engine = LLMEngine(model, max_num_seqs=max_num_seqs, **ENGINE)
    outputs = run(engine, ids, params)
    assert max(len(s.scheduled) for s in engine.stats) == max_num_seqs
    assert max(s.num_running for s in engine.stats) <= max_num_seqs
    assert engine.manager.pool.num_free_blocks == ENGINE["num_blocks"]
    alone = LLMEngine(model, max_num_seqs=8, **ENGINE).generate([ids] * 5, params, use_tqdm=False)
    assert [outputs[f"c{i}"] for i in range(5)] == [list(o.output_token_ids) for o in alone]


def test_a_choice_aborted_before_its_fork_never_runs(model):
    ids = CourseTokenizer().encode(PROMPT)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6) for s in range(3)]
    engine = LLMEngine(model, max_num_seqs=4, **ENGINE)
    engine.add_parallel_requests(["a", "b", "c"], ids, params)
    assert engine.abort_request("b") and "b" not in engine.requests
    seen = set()
    while engine.has_unfinished_requests():
        seen |= {out.request_id for out in engine.step()}
    assert seen == {"a", "c"} and engine.manager.pool.num_free_blocks == ENGINE["num_blocks"]


def test_a_server_with_max_num_seqs_2_runs_n_4_two_at_a_time(model):
    served = ServedModel("course", model, CourseTokenizer(), (), 1024)
    engine = LLMEngine(model, max_num_seqs=2, **ENGINE)
    server = ServerThread(create_app(served, engine, max_queued_requests=16)).start()
    try:
        body = dict(model="course", prompt=PROMPT, max_tokens=8, n=4, temperature=1.0, seed=3)
        response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
        assert all(c["finish_reason"] == "length" for c in choices)
        running, in_step = server.app.state.loop.call(
            lambda e: (
                max(s.num_running for s in e.stats),
                max(len(s.scheduled) for s in e.stats),
            )
        )
        assert running <= 2 and in_step == 2  # before the fix: 4 running, 4 in a step
    finally:
        server.stop()
