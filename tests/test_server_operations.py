"""Chapter 13's server as an operator runs it: a client that leaves a non-streamed request,
`/health`, `/metrics` (Prometheus text, vLLM's names, one registry per app), `--api-key`, the bind
refusal beyond loopback, OpenAI-shaped errors for FastAPI's own failures (invalid JSON, unknown
routes, wrong methods), and a failing step seen by a streamed and a non-streamed client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from kvlib.engine import LLMEngine
from kvlib.serve.__main__ import parse_options
from kvlib.serve.auth import check_bind, is_loopback
from kvlib.serve.metrics import metric_value, parse_metrics, scrape_metrics
from kvlib.serve.models import CourseTokenizer
from kvlib.serve.server import ServerThread, create_app, free_port
from tests import test_server
from tests.test_server import ENGINE, PROMPT, start_server, wait_idle

ERROR_KEYS = {"message", "type", "param", "code"}
model, served = test_server.model, test_server.served  # the course model and its server fixtures


@pytest.fixture
def fresh(served):
    """A server of its own (its counters start at 0), stopped after the test."""
    thread = start_server(served)
    yield thread
    thread.stop()


def scrape(server, name, **labels) -> float:
    return metric_value(scrape_metrics(server.root_url + "/metrics"), name, **labels)


def raw(server, method, path, body=None, headers=None):
    """(status, parsed JSON body or text, headers) of one HTTP request, errors included."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        server.root_url + path,
        data,
        {"Content-Type": "application/json", **(headers or {})},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, text, head = response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as error:
        status, text, head = error.code, error.read().decode(), error.headers
    try:
        return status, json.loads(text), head
    except json.JSONDecodeError:
        return status, text, head


# --- bug 1: a non-streamed request whose client left -----------------------------------------


@pytest.mark.timeout(60)
def test_a_non_streamed_request_whose_client_left_is_aborted(served):
    """An httpx client gives up after 0.1 s on max_tokens=1000 (at least half a second of steps
    on any CPU): the server notices the closed connection while the response is pending, aborts
    the engine request and frees its blocks long before 1000 steps; /metrics counts one abort and
    nothing finished. (Before the fix: every step ran, for nobody.)"""
    server = start_server(served, max_model_len=1024)  # PROMPT's 12 + 1000 tokens: 64 blocks
    try:
        max_tokens = 1000
        body = dict(model="course", prompt=PROMPT, max_tokens=max_tokens, temperature=0)
        with httpx.Client(timeout=0.1) as http, pytest.raises(httpx.ReadTimeout):
            http.post(server.base_url + "/completions", json=body)
        free, total = wait_idle(server, timeout_s=30)
        steps = server.app.state.loop.call(lambda engine: len(engine.stats))
        assert free == total
        assert steps < max_tokens // 2, f"{steps} engine steps ran for a client that left"
        assert server.app.state.loop.num_aborted == 1
        assert scrape(server, "vllm:request_success_total", finished_reason="abort") == 1
        assert scrape(server, "vllm:request_success_total") == 1  # nothing counted as finished
    finally:
        server.stop()


# --- /health -----------------------------------------------------------------------------------


def test_health_is_200_while_the_loop_lives_and_503_after_it_died(fresh):
    status, body, _ = raw(fresh, "GET", "/health")
    assert (status, body) == (200, "")
    loop = fresh.app.state.loop

    def broken():
        raise RuntimeError("injected loop bug")

    loop.call(lambda engine: setattr(engine, "has_unfinished_requests", broken))
    deadline = time.monotonic() + 10
    while loop.error is None:
        assert time.monotonic() < deadline, "the loop did not die"
        time.sleep(0.01)
    status, body, _ = raw(fresh, "GET", "/health")
    assert status == 503 and set(body["error"]) == ERROR_KEYS
    assert "injected loop bug" in body["error"]["message"]
    client = openai.OpenAI(base_url=fresh.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="course", prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503 and "not running" in str(info.value)


# --- /metrics ----------------------------------------------------------------------------------


def test_metrics_count_requests_tokens_and_latencies_as_vllm_names_them(fresh):
    client = openai.OpenAI(base_url=fresh.base_url, api_key="unused", max_retries=0)
    responses = [
        client.completions.create(model="course", prompt=PROMPT, max_tokens=5, temperature=0),
        client.completions.create(model="course", prompt=PROMPT, max_tokens=3, n=2, seed=1),
    ]
    text = responses[0].choices[0].text
    stop = text.split()[2]  # ends the third request after two tokens
    responses.append(
        client.completions.create(
            model="course", prompt=PROMPT, max_tokens=8, temperature=0, stop=stop, stream=False
        )
    )
    wait_idle(fresh)
    status, body, headers = raw(fresh, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = parse_metrics(body)
    assert {s.labels.get("model_name") for s in samples} == {"course"}

    def value(name, **labels):
        return metric_value(samples, name, **labels)

    choices = [c for r in responses for c in r.choices]
    tokens = sum(r.usage.completion_tokens for r in responses)
    reasons = [c.finish_reason for c in choices]
    assert reasons == ["length", "length", "length", "stop"]
    assert value("vllm:request_success_total", finished_reason="length") == 3
    assert value("vllm:request_success_total", finished_reason="stop") == 1
    assert value("vllm:request_success_total", finished_reason="abort") == 0
    assert value("vllm:generation_tokens_total") == tokens
    assert value("vllm:prompt_tokens_total") == 4 * len(CourseTokenizer().encode(PROMPT))
    assert value("vllm:time_to_first_token_seconds_count") == 4
    assert value("vllm:e2e_request_latency_seconds_count") == 4
    assert value("vllm:request_time_per_output_token_seconds_count") == 4  # each > 1 token
    assert value("vllm:inter_token_latency_seconds_count") == tokens - 4  # one per later token
    ttft_s = value("vllm:time_to_first_token_seconds_sum")
    assert 0 < ttft_s <= value("vllm:e2e_request_latency_seconds_sum")
    inf_bucket = value("vllm:time_to_first_token_seconds_bucket", le="+Inf")
    assert inf_bucket == 4
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(f"vllm:{gauge}") == 0, gauge  # idle: nothing running, every block free
    print(f"{len(samples)} samples; {tokens} tokens, finish reasons {reasons}")


def test_prefix_cache_phases_and_per_request_histograms_match_the_engines_records(served):
    """Issue 56, item 10: the metrics vLLM's operators read, checked against the engine's own
    `StepStats` records: prefix-cache queries and hits, tokens per step, per-request prompt and
    generation tokens, queue + prefill = TTFT; and no `_created` samples."""
    thread = start_server(served, enable_prefix_caching=True)
    try:
        client = openai.OpenAI(base_url=thread.base_url, api_key="unused", max_retries=0)
        prompt = " ".join([PROMPT] * 4)  # 48 tokens: three full blocks to share
        responses = [
            client.completions.create(model="course", prompt=prompt, max_tokens=4, temperature=0)
            for _ in range(2)
        ]
        wait_idle(thread)

        def totals(engine):
            stats = engine.stats
            return dict(
                queries=sum(s.prefix_query_tokens for s in stats),
                hits=sum(s.prefix_hit_tokens for s in stats),
                steps=len(stats),
                tokens=sum(
                    s.num_prefill_tokens + s.num_decode_tokens + s.num_recomputed_tokens
                    for s in stats
                ),
            )

        engine = thread.app.state.loop.call(totals)
        samples = scrape_metrics(thread.root_url + "/metrics")
    finally:
        thread.stop()

    def value(name):
        return metric_value(samples, name)

    prompt_tokens = len(CourseTokenizer().encode(prompt))
    generated = sum(r.usage.completion_tokens for r in responses)
    assert value("vllm:prefix_cache_queries_total") == engine["queries"] >= 2 * prompt_tokens - 2
    assert value("vllm:prefix_cache_hits_total") == engine["hits"] >= 32  # the second request's
    assert value("vllm:iteration_tokens_total_count") == engine["steps"]
    assert value("vllm:iteration_tokens_total_sum") == engine["tokens"]
    assert value("vllm:request_prompt_tokens_sum") == 2 * prompt_tokens
    assert value("vllm:request_generation_tokens_sum") == generated == 8
    for phase in ("queue", "prefill", "decode"):
        assert value(f"vllm:request_{phase}_time_seconds_count") == 2, phase
    phases = value("vllm:request_queue_time_seconds_sum") + value(
        "vllm:request_prefill_time_seconds_sum"
    )
    assert abs(phases - value("vllm:time_to_first_token_seconds_sum")) < 1e-6  # arrival -> 1st
    decode_s = value("vllm:request_decode_time_seconds_sum")
    assert 0 < decode_s < value("vllm:e2e_request_latency_seconds_sum")
    assert not [s.name for s in samples if s.name.endswith("_created")]


def test_gauges_show_a_running_request_and_its_blocks(fresh):
    client = openai.OpenAI(base_url=fresh.base_url, api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="course", prompt=PROMPT, max_tokens=400, temperature=0, stream=True
    )
    chunks = iter(stream)
    for _ in range(40):
        next(chunks)
    running = scrape(fresh, "vllm:num_requests_running")
    usage = scrape(fresh, "vllm:kv_cache_usage_perc")
    stream.close()
    most = -(-(12 + 400) // ENGINE["block_size"]) / ENGINE["num_blocks"]
    assert running == 1 and 3 / ENGINE["num_blocks"] <= usage <= most, usage
    wait_idle(fresh)
    assert scrape(fresh, "vllm:request_success_total", finished_reason="abort") == 1
    assert scrape(fresh, "vllm:kv_cache_usage_perc") == 0


def test_preemptions_are_counted(served):
    """A pool of 6 blocks for 4 requests of 12 + 40 tokens: the scheduler preempts; the counter
    equals the engine's own per-step count."""
    thread = start_server(served, num_blocks=6, max_num_batched_tokens=64)
    try:
        client = openai.OpenAI(base_url=thread.base_url, api_key="unused", max_retries=0)
        streams = [
            client.completions.create(
                model="course", prompt=PROMPT, max_tokens=40, temperature=0, stream=True
            )
            for _ in range(4)
        ]
        assert all(len(list(s)) == 40 for s in streams)
        wait_idle(thread)
        preempted = thread.app.state.loop.call(
            lambda engine: sum(s.num_preemptions for s in engine.stats)
        )
        assert preempted > 0
        assert scrape(thread, "vllm:num_preemptions_total") == preempted
    finally:
        thread.stop()


def test_two_apps_in_one_process_have_their_own_registries(served, model):
    """Each app registers its metrics in its own registry: a second app neither collides with
    the first nor sees its counts."""
    threads = [start_server(served), start_server(served)]
    try:
        client = openai.OpenAI(base_url=threads[0].base_url, api_key="unused", max_retries=0)
        client.completions.create(model="course", prompt=PROMPT, max_tokens=3)
        counts = [scrape(t, "vllm:generation_tokens_total") for t in threads]
        assert counts == [3, 0]
    finally:
        for thread in threads:
            thread.stop()


# --- --api-key -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(served):
    engine = LLMEngine(served.model, **{**ENGINE, "max_model_len": 512})
    thread = ServerThread(create_app(served, engine, api_key="sk-course")).start()
    yield thread
    thread.stop()


def test_an_api_key_guards_v1_with_openais_401(keyed):
    good = openai.OpenAI(base_url=keyed.base_url, api_key="sk-course", max_retries=0)
    r = good.completions.create(model="course", prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    stream = good.completions.create(model="course", prompt=PROMPT, max_tokens=3, stream=True)
    assert len(list(stream)) == 3
    wrong = openai.OpenAI(base_url=keyed.base_url, api_key="sk-other", max_retries=0)
    for call in (
        lambda: wrong.models.list(),
        lambda: wrong.completions.create(model="course", prompt=PROMPT, max_tokens=3),
    ):
        with pytest.raises(openai.AuthenticationError) as info:
            call()
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key" and set(info.value.body) == ERROR_KEYS
    for path in ("/v1/models", "/v1/nothing"):  # no header at all; unknown routes too
        status, body, headers = raw(keyed, "GET", path)
        assert status == 401 and set(body["error"]) == ERROR_KEYS, body
        assert "Authorization: Bearer" in body["error"]["message"]
        assert headers["www-authenticate"] == "Bearer"
    assert raw(keyed, "GET", "/health")[0] == 200  # open: a load balancer's probe has no key
    assert raw(keyed, "GET", "/metrics")[0] == 200


def test_create_app_refuses_an_empty_key(served, model):
    engine = LLMEngine(model, **ENGINE)
    with pytest.raises(ValueError, match="api_key"):
        create_app(served, engine, api_key="")
    with pytest.raises(TypeError, match="api_key"):
        create_app(served, engine, api_key=123)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "localhost"])
def test_loopback_hosts_need_no_key(host):
    assert is_loopback(host)
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "no-such-host.invalid"])
def test_a_host_beyond_loopback_needs_a_key_or_allow_no_auth(host, served, model):
    assert not is_loopback(host)
    with pytest.raises(PermissionError, match="--api-key") as info:
        check_bind(host, None)
    assert "--allow-no-auth" in str(info.value) and repr(host) in str(info.value)
    check_bind(host, "sk-key")
    check_bind(host, None, allow_no_auth=True)
    with pytest.raises(PermissionError):
        ServerThread(create_app(served, LLMEngine(model, **ENGINE)), host=host)


def test_command_line_options_read_the_key_and_refuse_an_open_bind(capsys):
    with pytest.raises(SystemExit) as info:
        parse_options(["--host", "0.0.0.0"], environ={})
    error = capsys.readouterr().err
    assert info.value.code == 2 and "without an API key" in error and "--allow-no-auth" in error
    assert parse_options(["--host", "0.0.0.0"], environ={"KVLIB_API_KEY": "k1"}).api_key == "k1"
    args = parse_options(["--api-key", "k2"], environ={"KVLIB_API_KEY": "k1"})
    assert args.api_key == "k2"  # the flag wins over the environment
    assert parse_options(["--host", "0.0.0.0", "--allow-no-auth"], environ={}).api_key is None
    assert parse_options([], environ={}).api_key is None  # loopback: open by default
    with pytest.raises(SystemExit):
        parse_options(["--api-key", " "], environ={})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_command_line_serves_with_kvlib_api_key():
    """`KVLIB_API_KEY=... python -m kvlib.serve --model course`: 401 without the key, 200 with
    it, /health open; and `--host 0.0.0.0` without a key exits with status 2 and the reason."""
    refused = subprocess.run(
        [sys.executable, "-m", "kvlib.serve", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env={k: v for k, v in __import__("os").environ.items() if k != "KVLIB_API_KEY"},
        timeout=60,
    )
    assert refused.returncode == 2 and "without an API key" in refused.stderr
    port = free_port()
    env = {**__import__("os").environ, "KVLIB_API_KEY": "sk-env"}
    command = [sys.executable, "-m", "kvlib.serve", "--model", "course", "--port", str(port)]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    try:
        root = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(root + "/health", timeout=5)
                break
            except OSError:
                assert process.poll() is None, process.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        anonymous = openai.OpenAI(base_url=root + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        keyed = openai.OpenAI(base_url=root + "/v1", api_key="sk-env", max_retries=0)
        assert [m.id for m in keyed.models.list().data] == ["course"]
    finally:
        process.terminate()
        process.wait(20)


# --- OpenAI-shaped errors for what FastAPI itself refuses ---------------------------------------


@pytest.fixture(scope="module")
def server(served):
    thread = start_server(served)
    yield thread
    thread.stop()


@pytest.mark.parametrize(
    "method, path, body, status, words",
    [
        ("POST", "/v1/completions", b"{not json", 400, "not valid JSON"),
        ("POST", "/v1/completions", b"[]", 400, "the request body: Input should be a valid"),
        ("POST", "/v1/nothing", {"model": "course"}, 404, "POST /v1/nothing: no such route"),
        ("GET", "/nothing", None, 404, "GET /nothing: no such route"),
        ("GET", "/v1/completions", None, 405, "this route takes POST"),
        ("DELETE", "/v1/models", None, 405, "this route takes GET"),
    ],
)
def test_fastapis_own_errors_have_openais_shape(server, method, path, body, status, words):
    got, payload, _ = raw(server, method, path, body)
    assert got == status and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error"
    assert error["param"] is None and words in error["message"], error


# --- a failing step, streamed and not ----------------------------------------------------------


def break_next_step(server, message):
    engine = server.app.state.loop.engine
    original = engine.step

    def broken():
        engine.step = original
        raise RuntimeError(message)

    server.app.state.loop.call(lambda e: setattr(e, "step", broken))


def test_a_failing_step_is_a_500_or_an_error_event_once_streaming(fresh):
    """Non-streamed: HTTP 500 with OpenAI's body. Streamed: the 200 and its headers are already
    sent, so the failure arrives as a `data: {"error": ...}` event, then `data: [DONE]` as the
    stream's end (issue 56, item 9); the openai client raises `APIError`. Both count as
    finished_reason="error"."""
    client = openai.OpenAI(base_url=fresh.base_url, api_key="unused", max_retries=0)
    gate = threading.Event()
    loop = fresh.app.state.loop
    holder = threading.Thread(target=lambda: loop.call(lambda e: gate.wait(20)))
    holder.start()  # hold the engine thread so that the stream starts before the step fails
    breaker = threading.Thread(target=break_next_step, args=(fresh, "injected in a stream"))
    try:
        stream = client.completions.create(model="course", prompt=PROMPT, max_tokens=4, stream=True)
        breaker.start()  # queued behind the request: the engine takes both before its next step
        deadline = time.monotonic() + 10
        while loop.inbox.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert loop.inbox.qsize() == 2, "the request and the broken step are queued"
    finally:
        gate.set()
        holder.join()
        if breaker.ident is not None:  # started
            breaker.join()
    with pytest.raises(openai.APIError, match="injected in a stream"):
        list(stream)
    break_next_step(fresh, "injected, not streamed")
    with pytest.raises(openai.InternalServerError, match="injected, not streamed"):
        client.completions.create(model="course", prompt=PROMPT, max_tokens=4)
    body = json.dumps(dict(model="course", prompt=PROMPT, max_tokens=3, stream=True)).encode()
    break_next_step(fresh, "injected, raw")
    request = urllib.request.Request(
        fresh.base_url + "/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert response.status == 200 and events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert set(last["error"]) == ERROR_KEYS and "injected, raw" in last["error"]["message"]
    wait_idle(fresh)
    assert scrape(fresh, "vllm:request_success_total", finished_reason="error") == 3


def test_the_metrics_scraper_records_a_run(fresh):
    from kvlib.serve.load import MetricsScraper

    client = openai.OpenAI(base_url=fresh.base_url, api_key="unused", max_retries=0)
    with MetricsScraper(fresh.root_url + "/metrics", interval_s=0.01) as scraper:
        stream = client.completions.create(
            model="course", prompt=PROMPT, max_tokens=60, temperature=0, stream=True
        )
        assert len(list(stream)) == 60
    times, running = scraper.series("vllm:num_requests_running")
    assert len(times) == len(scraper.scrapes) >= 2 and times == sorted(times)
    assert set(running) <= {0.0, 1.0} and max(running) == 1.0  # seen running, by a scrape
    assert metric_value(scraper.last, "vllm:generation_tokens_total") == 60
    with pytest.raises(ValueError, match="interval_s"):
        MetricsScraper(fresh.root_url + "/metrics", interval_s=0)
