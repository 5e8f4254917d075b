"""Issue 56: chapter 13's server against what real clients send (the `openai` client, raw HTTP
as httpx or langchain sends it): OpenAI's message forms, explicit nulls and neutral values, body
and queue limits, protocol details of streams, a slow tokenizer that must not stall other
streams. Each test failed before its fix. SmolLM2-specific cases (its tokenizer) are in
tests/test_server.py, beside its tokenizer's fixture."""

from __future__ import annotations

import http.client
import json
import threading
import time

import httpx
import openai
import pytest

from kvlib.engine import LLMEngine
from kvlib.serve.models import CourseTokenizer, ServedModel
from kvlib.serve.server import ServerThread, create_app
from tests import test_server
from tests.test_server import ENGINE, PROMPT, start_server

model, served = test_server.model, test_server.served  # the course model and its server fixtures


class CourseChatTokenizer(CourseTokenizer):
    """The course tokenizer with a chat "template" that joins the contents (course words) and
    records the messages it was given, so a test sees what the template received."""

    chat_template = "contents joined with spaces"

    def __init__(self):
        super().__init__()
        self.rendered: list[list[dict]] = []

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.rendered.append(messages)
        return self.encode(" ".join(m["content"] for m in messages))


@pytest.fixture(scope="module")
def chat_server(model):
    tokenizer = CourseChatTokenizer()
    chat = ServedModel("course", model, tokenizer, (), 1024)
    thread = start_server(chat, max_queued_requests=4)
    yield thread, tokenizer
    thread.stop()


def post(server, path, body, **options):
    with httpx.Client(timeout=30) as client:
        return client.post(server.base_url + path, json=body, **options)


def test_openai_chat_message_forms_are_accepted(chat_server):
    """Content as text parts (joined with newlines), `name` (LangChain sends it), the developer
    role (rendered as system), an assistant's null content: a 200, not a 400."""
    server, tokenizer = chat_server
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    messages = [
        {"role": "developer", "content": "BOS SET k1 v2"},
        {"role": "assistant", "content": None},
        {
            "role": "user",
            "name": "alice",
            "content": [{"type": "text", "text": "SET k3 v4"}, {"type": "text", "text": "GET k1"}],
        },
    ]
    r = client.chat.completions.create(model="course", messages=messages, max_tokens=2)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].message.content.split()) == 2
    assert tokenizer.rendered[-1] == [
        {"role": "system", "content": "BOS SET k1 v2"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "SET k3 v4\nGET k1"},
    ]


@pytest.mark.parametrize(
    "message,param,words",
    [
        ({"role": "tool", "content": None, "tool_call_id": "call_1"}, "messages.1.role", "tool"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1"}]},
            "messages.1.tool_calls",
            "tool",
        ),
        ({"role": "user", "content": None}, "messages.1.content", "required"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages.1.content.0.type",
            "only text parts",
        ),
    ],
)
def test_tool_messages_get_a_clear_400_not_a_shape_error(chat_server, message, param, words):
    server, _ = chat_server
    body = {"model": "course", "messages": [{"role": "user", "content": "GET k1"}, message]}
    r = post(server, "/chat/completions", body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"], error


def test_explicit_nulls_and_neutral_values_are_accepted(chat_server):
    """api.py's docstring promised it: null n/stream/echo/logit_bias/top_logprobs, text
    response_format, no tools, tool_choice none, store false, a negative seed (reproducible)."""
    server, _ = chat_server
    nulls = dict(n=None, stream=None, logit_bias=None, stream_options=None, seed=-5)
    completion = dict(model="course", prompt=PROMPT, max_tokens=3, temperature=1.0, **nulls)
    first = post(server, "/completions", {**completion, "echo": None, "logprobs": None})
    again = post(server, "/completions", {**completion, "echo": False, "logit_bias": {}})
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]  # seed -5
    chat = dict(
        model="course",
        messages=[{"role": "user", "content": "BOS SET k1 v2 GET k1"}],
        max_tokens=2,
        top_logprobs=None,
        logprobs=None,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        store=False,
        parallel_tool_calls=None,
        **nulls,
    )
    r = post(server, "/chat/completions", chat)
    assert r.status_code == 200, r.text
    for field, value in [("logit_bias", {"5": 1.0}), ("tool_choice", "auto"), ("store", True)]:
        r = post(server, "/chat/completions", {**chat, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_request_that_can_never_fit_is_a_400_and_a_full_queue_a_429_with_retry_after(
    chat_server,
):
    """Five prompts (or n = 5) on a server that queues 4: a 400 the openai client does not retry
    (before: a 429 without Retry-After, retried 3 times). A queue full for now: 429 with
    Retry-After."""
    server, _ = chat_server
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=3)
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="course", prompt=[PROMPT] * 5, max_tokens=2)
    assert info.value.body["param"] == "prompt" and time.monotonic() - start < 5
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="course", prompt=PROMPT, max_tokens=2, n=5)
    assert info.value.body["param"] == "n"
    loop, gate = server.app.state.loop, threading.Event()
    holder = threading.Thread(target=lambda: loop.call(lambda e: gate.wait(20)))
    holder.start()  # the engine thread waits: accepted requests stay in flight
    try:
        with httpx.Client(timeout=30) as http:
            body = dict(model="course", prompt=[PROMPT] * 4, max_tokens=2, stream=True)
            with http.stream("POST", server.base_url + "/completions", json=body) as held:
                assert held.status_code == 200
                r = http.post(server.base_url + "/completions", json={**body, "stream": False})
                assert r.status_code == 429 and r.headers["retry-after"] == "1", r.headers
                gate.set()
                assert held.read().decode().endswith("data: [DONE]\n\n")
    finally:
        gate.set()
        holder.join()


def sse_events(response) -> list[str]:
    return [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]


def test_stream_options_need_stream_and_usage_is_null_until_the_last_chunk(chat_server):
    server, _ = chat_server
    body = dict(model="course", prompt=PROMPT, max_tokens=3)
    r = post(server, "/completions", {**body, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    for path, extra in [
        ("/completions", {}),
        ("/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ]:
        request = {**body, **extra, "stream": True, "stream_options": {"include_usage": True}}
        if extra:
            request.pop("prompt")
        events = sse_events(post(server, path, request))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
        assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []


class SlowTokenizer(CourseTokenizer):
    """The course tokenizer, taking `SLOW_S` seconds (a sleep, as a long text takes a real
    tokenizer) over texts longer than 10k characters."""

    SLOW_S = 1.5

    def encode(self, text):
        if len(text) > 10_000:
            time.sleep(self.SLOW_S)
        return super().encode(text)


@pytest.mark.timeout(120)
def test_a_huge_prompt_stalls_no_other_stream_and_a_huge_body_is_a_413(model):
    """Tokenization runs off the event loop (before: a 9.6 MB prompt stalled every stream for
    7.3 s), a prompt whose length bound exceeds the context is refused without being tokenized,
    and a body over the limit is refused at once, the connection kept."""
    slow = ServedModel("course", model, SlowTokenizer(), (), 1024)
    engine = LLMEngine(model, **{**ENGINE, "max_model_len": 512})
    app = create_app(slow, engine, max_body_bytes=2**20)
    with ServerThread(app) as server:
        gaps, stop = [], threading.Event()

        def stream():
            body = dict(model="course", prompt=[2, 9, 42] * 4, max_tokens=490, stream=True)
            with httpx.Client(timeout=60) as client:
                with client.stream("POST", server.base_url + "/completions", json=body) as r:
                    last = None
                    for _ in r.iter_lines():
                        now = time.perf_counter()
                        if last is not None and not stop.is_set():
                            gaps.append(now - last)
                        last = now

        reader = threading.Thread(target=stream)
        reader.start()
        while not gaps:
            time.sleep(0.01)
        start = time.perf_counter()
        long = ("k1" + " " * 40) * 400  # 16,800 characters, 400 tokens: fits, tokenized slowly
        fits = post(server, "/completions", dict(model="course", prompt=long, max_tokens=2))
        slow_s = time.perf_counter() - start
        window = len(gaps)
        start = time.perf_counter()
        huge = post(server, "/completions", dict(model="course", prompt="k1 " * 300_000))
        refused_s = time.perf_counter() - start
        stop.set()
        assert fits.status_code == 200, fits.text
        assert slow_s >= SlowTokenizer.SLOW_S and window > 10, (slow_s, window)
        assert max(gaps[:window]) < SlowTokenizer.SLOW_S / 2, max(gaps[:window])
        # 300,000 words cannot fit 512 tokens: refused from its length bound, never tokenized
        error = huge.json()["error"]
        assert huge.status_code == 400 and error["code"] == "context_length_exceeded", error
        assert "at least 300000 tokens (not tokenized)" in error["message"], error
        assert refused_s < SlowTokenizer.SLOW_S, refused_s
        reader.join()
        connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
        body = json.dumps(dict(model="course", prompt="k1 " * 400_000)).encode()  # 1.2 MB
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 413 and "limit of 1048576 bytes" in error["message"], error
        socket = connection.sock
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200 and connection.sock is socket
        connection.close()
