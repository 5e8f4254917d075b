"""Chapter 13's server, tested with the real `openai` client against a server on 127.0.0.1 (a free
port): the API, streaming, stop strings, n > 1, logprobs, seeds, errors, aborts, a 200-client load
test; the engine's additions (abort, fork, logprobs) and the text side (incremental
detokenization, stop strings) against oracles."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.engine import LLMEngine, SamplingParams
from kvlib.loaders.course_model import load_course_model
from kvlib.serve.detokenize import REPLACEMENT_CHARACTER, IncrementalDetokenizer, StopStringMatcher
from kvlib.serve.models import CourseTokenizer, ServedModel
from kvlib.serve.server import ServerThread, create_app

ENGINE = dict(num_blocks=64, block_size=16, max_num_seqs=32, max_num_batched_tokens=256)
PROMPT = "BOS SET k1 v2 SET k3 v4 w5 w6 w7 GET k1"


@pytest.fixture(scope="module")
def model():
    return load_course_model()


@pytest.fixture(scope="module")
def served(model):
    return ServedModel("course", model, CourseTokenizer(), (), 1024)


def start_server(served, **options):
    queued = options.pop("max_queued_requests", 256)
    engine = LLMEngine(served.model, **{**ENGINE, "max_model_len": 512, **options})
    return ServerThread(create_app(served, engine, max_queued_requests=queued)).start()


@contextlib.contextmanager
def serving(served, **options):
    """A server of its own for a `with` block (`start_server`, stopped at the end)."""
    thread = start_server(served, **options)
    try:
        yield thread
    finally:
        thread.stop()


@pytest.fixture(scope="module")
def server(served):
    thread = start_server(served)
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def pool_state(server):
    """(free blocks, blocks) read in the engine thread between steps, invariants checked."""

    def read(engine):
        engine.manager.check_invariants()
        return engine.manager.pool.num_free_blocks, engine.config.num_blocks

    return server.app.state.loop.call(read)


def wait_idle(server, timeout_s=10.0):
    """Wait until the engine loop holds no request; return the pool state."""
    loop = server.app.state.loop
    deadline = time.monotonic() + timeout_s
    while loop.num_in_flight or loop.call(lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, f"{loop.num_in_flight} requests still in flight"
        time.sleep(0.01)
    return pool_state(server)


def engine_greedy(model, prompt_ids, max_tokens, **options):
    engine = LLMEngine(model, **{**ENGINE, "max_model_len": 512, **options})
    (out,) = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    return list(out.output_token_ids)


# --- the text side -------------------------------------------------------------------------------


def byte_tokens(text: str, sizes) -> list[bytes]:
    """Split text's UTF-8 bytes into tokens of the given sizes (cycled): characters get cut."""
    data, tokens, i, k = text.encode(), [], 0, 0
    while i < len(data):
        tokens.append(data[i : i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return tokens


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=30), st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_incremental_detokenizer_never_splits_a_character(text, sizes):
    vocab = byte_tokens(text, sizes)

    def decode(ids):  # a byte-level tokenizer's decode: join the bytes, replace what is unfinished
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    detokenizer = IncrementalDetokenizer(decode)
    deltas = [detokenizer.push(i) for i in range(len(vocab))] + [detokenizer.flush()]
    assert "".join(deltas) == text
    if REPLACEMENT_CHARACTER not in text:
        assert all(REPLACEMENT_CHARACTER not in d for d in deltas), deltas
    naive = "".join(decode([i]) for i in range(len(vocab)))  # the pitfall: token by token
    if len(text.encode()) > len(text) and max(sizes) < 4:
        assert naive != text or all(len(t) == 1 for t in text)


@settings(max_examples=150, deadline=None)
@given(
    st.text(alphabet="abc\n", max_size=30),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=3), min_size=1, max_size=3),
    st.lists(st.integers(1, 5), min_size=1, max_size=5),
)
def test_stop_string_matcher_against_find(text, stops, cuts):
    matcher, sent, i, stopped = StopStringMatcher(stops), "", 0, False
    for piece in _pieces(text, cuts):
        i += len(piece)
        safe, stopped = matcher.push(piece)
        sent += safe
        received = text[:i]
        # never leaked: what was sent is the received text with any stop-string start held back
        assert received.startswith(sent)
        assert not any(s in sent for s in stops)
        if stopped:
            break
    if not stopped:
        sent += matcher.flush()
    received, expected, found = "", text, False  # the spec: after each piece, the earliest stop
    for piece in _pieces(text, cuts):  # string present in what was received
        received += piece
        hits = [received.find(s) for s in stops if s in received]
        if hits:
            expected, found = received[: min(hits)], True
            break
    assert (sent, stopped) == (expected, found)


def _pieces(text, cuts):
    i, k = 0, 0
    while i < len(text):
        yield text[i : i + cuts[k % len(cuts)]]
        i, k = i + cuts[k % len(cuts)], k + 1


def test_stop_string_matcher_refuses_empty():
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher([""])


# --- engine additions ----------------------------------------------------------------------------


def test_abort_frees_blocks_and_keeps_invariants(model):
    engine = LLMEngine(model, **ENGINE)
    prompt = CourseTokenizer().encode(PROMPT) * 3
    for i in range(3):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12))
    for _ in range(5):
        engine.step()
    assert engine.abort_request("r1") and engine.abort_request("r2")
    engine.manager.check_invariants()
    assert not engine.abort_request("r1")  # already gone
    while engine.has_unfinished_requests():
        engine.step()
    engine.manager.check_invariants()
    assert engine.manager.pool.num_free_blocks == ENGINE["num_blocks"]
    assert list(engine.requests) == ["r0"]


@pytest.mark.parametrize("prompt_len", [7, 8, 9])  # the fork's last block: partial, full, one
def test_fork_matches_independent_requests(model, prompt_len):
    prompt = CourseTokenizer().encode(PROMPT)[:prompt_len]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, logprobs=1) for s in (7, 8, 9)]
    small_blocks = {**ENGINE, "block_size": 4}
    forked = LLMEngine(model, **small_blocks)
    forked.add_parallel_requests(["a", "b", "c"], prompt, params)
    outputs, shared = {}, False
    while forked.has_unfinished_requests():
        for out in forked.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        forked.manager.check_invariants()
        tables = forked.manager.block_tables
        if {"a", "b"} <= set(tables):
            shared |= tables["a"][0] == tables["b"][0]  # the prompt's first block, shared
    assert shared
    assert forked.manager.pool.num_free_blocks == ENGINE["num_blocks"]
    alone = LLMEngine(model, **small_blocks).generate([prompt] * 3, params, use_tqdm=False)
    assert [outputs[i] for i in "abc"] == [list(o.output_token_ids) for o in alone]


def test_parallel_requests_with_a_one_token_prompt_are_not_forked(model):
    """A one-token prompt has nothing computed to share: its choices run as separate requests
    (a fork would keep 0 prompt tokens), with the tokens they give alone."""
    prompt = CourseTokenizer().encode(PROMPT)[:1]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6) for s in (3, 4)]
    engine = LLMEngine(model, **ENGINE)
    engine.add_parallel_requests(["a", "b"], prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.manager.check_invariants()
    assert engine.manager.pool.num_free_blocks == ENGINE["num_blocks"]
    alone = LLMEngine(model, **ENGINE).generate([prompt] * 2, params, use_tqdm=False)
    assert [outputs[i] for i in "ab"] == [list(o.output_token_ids) for o in alone]


# --- the API with the openai client --------------------------------------------------------------


def test_models_and_greedy_completion_equal_the_engine(client, model, served):
    assert [m.id for m in client.models.list().data] == ["course"]
    ids = served.tokenizer.encode(PROMPT)
    expected = served.decode(engine_greedy(model, ids, 12))
    for prompt in (PROMPT, ids):  # text or token ids
        r = client.completions.create(model="course", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == " " + expected
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)


def test_streaming_concatenates_to_the_completion(client):
    full = client.completions.create(model="course", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model="course",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == full.choices[0].text
    assert len(texts) == 10  # one event per token: the course tokenizer never holds text back
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_sse_wire_format_ends_with_done(server):
    body = json.dumps(dict(model="course", prompt=PROMPT, max_tokens=3, stream=True)).encode()
    request = urllib.request.Request(
        server.base_url + "/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and len(events) == 4


def test_stop_strings_cut_before_the_stop_and_free_blocks(client, server):
    greedy = client.completions.create(model="course", prompt=PROMPT, max_tokens=16, temperature=0)
    text = greedy.choices[0].text
    stop = text[5:11]  # spans token boundaries
    expected = text[: text.find(stop)]
    r = client.completions.create(
        model="course", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "zzz"]
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    assert r.usage.completion_tokens < 16
    streamed = client.completions.create(
        model="course", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected
    free, total = wait_idle(server)
    assert free == total


def test_seeded_sampling_is_reproducible_and_n2_forks(client):
    def sample(seed, n=1):
        r = client.completions.create(
            model="course", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed, n=n
        )
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)
    assert sample(11, n=2) == sample(11) + sample(12)  # choice i uses seed + i


def test_logprobs_match_a_full_forward(client, model, served):
    r = client.completions.create(
        model="course", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    ids = served.tokenizer.encode(PROMPT)
    out = served.tokenizer.encode(r.choices[0].text)
    with torch.no_grad():
        logits = model(torch.tensor([ids + out]))[0, len(ids) - 1 : -1]  # (6, V)
    oracle = logits.float().log_softmax(-1)
    chosen = oracle.gather(1, torch.tensor(out)[:, None])[:, 0]
    diff = (torch.tensor(lp.token_logprobs) - chosen).abs().max().item()
    assert diff < 1e-4, diff
    assert [t.strip() for t in lp.tokens] == r.choices[0].text.split()
    assert all(
        len(top) == 3 and max(top.values()) == p
        for top, p in zip(lp.top_logprobs, lp.token_logprobs)
    )
    # the chosen token's entry is keyed by its text in `tokens` (leading space included)
    assert [top[t] for t, top in zip(lp.tokens, lp.top_logprobs)] == lp.token_logprobs
    assert all(all(k.startswith(" ") for k in top) for top in lp.top_logprobs)
    stream = client.completions.create(
        model="course", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True
    )
    streamed = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs is not None]
    assert sum((x.tokens for x in streamed), []) == lp.tokens
    assert sum((x.top_logprobs for x in streamed), []) == lp.top_logprobs


def name_bytes(name: str) -> bytes:
    """The bytes an OpenAI logprobs token name stands for: its text, or `bytes:` + escapes."""
    if not name.startswith("bytes:"):
        return name.encode()
    out, rest = bytearray(), name[len("bytes:") :]
    while rest:
        if rest.startswith("\\x"):
            out.append(int(rest[2:4], 16))
            rest = rest[4:]
        else:
            out += rest[0].encode()
            rest = rest[1:]
    return bytes(out)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from kvlib.loaders.gguf import load_gguf_tokenizer
    from kvlib.loaders.smollm2 import smollm2_gguf_path

    return load_gguf_tokenizer(smollm2_gguf_path())


def test_sampled_token_is_in_top_logprobs_and_logprobs_0_gives_it_alone(client, model, served):
    """OpenAI: top_logprobs holds the `logprobs` most likely tokens and the sampled one ("up to
    logprobs+1 elements"); logprobs=0 returns the sampled token's logprob, not null. Checked
    against a full forward (the issue's case: logprobs=1, temperature=2, seed=3)."""
    ids = served.tokenizer.encode(PROMPT)
    for num_top in (1, 0):
        r = client.completions.create(
            model="course", prompt=PROMPT, max_tokens=16, temperature=2, seed=3, logprobs=num_top
        )
        lp = r.choices[0].logprobs
        out = served.tokenizer.encode(r.choices[0].text)
        with torch.no_grad():
            logits = model(torch.tensor([ids + out]))[0, len(ids) - 1 : -1]  # (16, V)
        oracle = logits.float().log_softmax(-1)
        argmax = oracle.argmax(-1).tolist()
        for k, (token, p, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
            assert top[token] == p and abs(p - oracle[k, out[k]].item()) < 1e-4, (k, top, p)
            expected = {token} | ({" " + served.tokenizer.names[argmax[k]]} if num_top else set())
            assert set(top) == expected, (k, top, expected)
        sampled_outside = sum(len(top) == 2 for top in lp.top_logprobs)
        if num_top:  # temperature 2 samples outside the top 1: those tokens add an entry
            assert sampled_outside > 0 and all(len(t) <= 2 for t in lp.top_logprobs)
        else:
            assert sampled_outside == 0


def test_token_names_follow_openai_for_byte_level_tokens(smol_tokenizer):
    """SmolLM2's byte-level tokens (tokenizer only, made-up logprobs): a token that ends inside a
    character is named `bytes:\\xNN...` in `tokens` and in `top_logprobs` alike, so two such
    tokens never collide as keys (decoded, both would be U+FFFD); the names' bytes concatenate to
    the text's; the offsets count released characters."""
    from kvlib.engine import FinishReason, RequestOutput
    from kvlib.engine.request import TokenLogprobs
    from kvlib.serve.choices import Choice
    from kvlib.serve.logprobs import token_bytes

    tokenizer = smol_tokenizer
    served = ServedModel("smollm2", None, tokenizer, (tokenizer.eos_token_id,), 2048)
    prompt, text = tokenizer.encode("Say:"), " naïve 日本 ok"
    out = tokenizer.encode(text)
    partial = [i for i in range(300) if _invalid_utf8(token_bytes(tokenizer, i)) and i not in out]
    partial = partial[:2]  # two tokens that decode alike: U+FFFD
    assert len(partial) == 2 and tokenizer.decode(partial[:1]) == tokenizer.decode(partial[1:])
    choice = Choice("r", 0, served, prompt, stop=[], logprobs=3)
    for k, token_id in enumerate(out):
        top = ((partial[0], -0.25), (partial[1], -0.5), (token_id, -0.75))
        entry = TokenLogprobs(token_id, -0.75, top)
        done = k == len(out) - 1
        reason = FinishReason.LENGTH if done else None
        choice.accept(RequestOutput("r", prompt, out[: k + 1], [token_id], done, reason, [entry]))
    lp = choice.completion_logprobs()
    assert choice.text == text
    assert any(t.startswith("bytes:") for t in lp["tokens"])  # some token ends in a character
    assert b"".join(name_bytes(t) for t in lp["tokens"]) == text.encode()
    for token_id, name, top in zip(out, lp["tokens"], lp["top_logprobs"]):
        assert name_bytes(name) == token_bytes(tokenizer, token_id)
        assert len(top) == 3 and top[name] == -0.75  # no key lost to a collision
        expected = [token_bytes(tokenizer, i) for i in (*partial, token_id)]
        assert [name_bytes(key) for key in top] == expected
    released = [len(t) for t in choice.token_texts]
    assert lp["text_offset"] == [sum(released[:k]) for k in range(len(out))]


def _invalid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_every_smollm2_token_has_one_name_and_its_bytes(smol_tokenizer):
    """Over the whole vocabulary: the byte alphabet is the tokenizers library's; a token whose
    bytes are valid UTF-8 is named by the text the tokenizer decodes for it alone; every name is
    unique (49,152 distinct keys)."""
    from tokenizers import pre_tokenizers

    from kvlib.serve.logprobs import _byte_alphabet, token_bytes, token_name

    assert set(_byte_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())
    size = smol_tokenizer.backend.get_vocab_size()
    names, num_partial = set(), 0
    for token_id in range(size):
        data = token_bytes(smol_tokenizer, token_id)
        name = token_name(data)
        names.add(name)
        if name.startswith("bytes:"):
            num_partial += 1
            assert name_bytes(name) == data
        else:
            assert name == smol_tokenizer.decode([token_id]), token_id
    assert len(names) == size and num_partial > 0
    print(f"{size} tokens, {num_partial} named by their bytes, all names distinct")


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        (dict(temperature=-0.5), 400, "temperature"),
        (dict(top_p=0), 400, "top_p"),
        (dict(max_tokens=0), 400, "max_tokens"),
        (dict(n=0), 400, "n"),
        (dict(logprobs=99), 400, "logprobs"),
        (dict(stop=[""]), 400, "stop"),
        (dict(echo=True), 400, "echo"),
        (dict(frequency_penalty=0.5), 400, "frequency_penalty"),
        (dict(extra_body={"bogus": 1}), 400, "bogus"),
        (dict(extra_body={"top_k": "ten"}), 400, "top_k"),
        (dict(prompt="hello world"), 400, "prompt"),
        (dict(prompt=[1, 2, 999]), 400, "prompt"),
        (dict(prompt=[]), 400, "prompt"),
        (dict(prompt=[True, False]), 400, "prompt"),  # not token ids
        (dict(prompt=[[1, 2.5]]), 400, "prompt"),
        (dict(max_tokens=600), 400, "prompt"),  # prompt + max_tokens > max_model_len (512)
        (dict(prompt=[1] * 600), 400, "prompt"),
        (dict(model="gpt-4o"), 404, "model"),
    ],
)
def test_errors_are_openai_style_and_name_the_field(client, kwargs, status, param):
    request = dict(model="course", prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**request)
    assert info.value.status_code == status
    error = info.value.body
    assert error["param"] == param and param in error["message"], error


def test_chat_without_a_template_and_malformed_bodies(client, server):
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="course", messages=[{"role": "user", "content": "x"}])
    for raw in (b"{not json", b"[]", b'{"model": "course"}', b'{"model": 3, "prompt": {}}'):
        request = urllib.request.Request(
            server.base_url + "/completions", raw, {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 400
        assert "message" in json.loads(info.value.read())["error"]
    # the loop survived all of it
    r = client.completions.create(model="course", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_a_failing_step_fails_its_requests_not_the_loop(client, server):
    engine = server.app.state.loop.engine
    original = engine.step

    def broken():
        engine.step = original
        raise RuntimeError("injected")

    server.app.state.loop.call(lambda e: setattr(e, "step", broken))
    with pytest.raises(openai.InternalServerError, match="injected"):
        client.completions.create(model="course", prompt=PROMPT, max_tokens=4)
    r = client.completions.create(model="course", prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    free, total = wait_idle(server)
    assert free == total


def test_a_step_failing_with_a_value_error_is_still_a_500(client, server):
    """Only `add` refusing a request is the client's fault (400); a step that raises, whatever
    its exception type, is the server's (500)."""
    engine = server.app.state.loop.engine
    original = engine.step

    def broken():
        engine.step = original
        raise ValueError("injected")

    server.app.state.loop.call(lambda e: setattr(e, "step", broken))
    with pytest.raises(openai.InternalServerError, match="injected"):
        client.completions.create(model="course", prompt=PROMPT, max_tokens=4)
    free, total = wait_idle(server)
    assert free == total


def test_n2_with_a_one_token_prompt_fails_nobody(client, server):
    """A one-token prompt has nothing to fork (a child keeps prompt - 1 = 0 tokens): its choices
    are served as separate requests, and a request in flight beside it is not failed."""
    loop = server.app.state.loop
    errors_before = loop.num_step_errors
    other = client.completions.create(
        model="course", prompt=PROMPT, max_tokens=200, temperature=0, stream=True
    )
    first = next(iter(other))
    r = client.completions.create(model="course", prompt="BOS", max_tokens=3, n=2, seed=5)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 6
    alone = [
        client.completions.create(model="course", prompt="BOS", max_tokens=3, seed=s)
        for s in (5, 6)
    ]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    rest = [c.choices[0] for c in other]
    assert rest[-1].finish_reason == "length" and first.choices[0].text
    assert loop.num_step_errors == errors_before
    free, total = wait_idle(server)
    assert free == total


def test_full_queue_is_a_429(served):
    thread = start_server(served, max_queued_requests=2)
    loop, gate = thread.app.state.loop, threading.Event()
    try:
        holder = threading.Thread(target=lambda: loop.call(lambda e: gate.wait(20)))
        holder.start()  # the engine thread now waits: accepted requests stay in flight
        client = openai.OpenAI(base_url=thread.base_url, api_key="unused", max_retries=0)
        streams = [
            client.completions.create(model="course", prompt=PROMPT, max_tokens=4, stream=True)
            for _ in range(2)
        ]
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="course", prompt=PROMPT, max_tokens=4)
        assert info.value.status_code == 429 and "queues at most 2" in str(info.value)
        gate.set()
        assert all(len([c for c in s]) == 4 for s in streams)
        holder.join()
    finally:
        gate.set()
        thread.stop()


def test_disconnect_mid_stream_aborts_and_frees_blocks(client, server):
    loop = server.app.state.loop
    aborted = loop.num_aborted
    stream = client.completions.create(
        model="course",
        prompt=" ".join([PROMPT] * 4),
        max_tokens=400,
        temperature=0,
        stream=True,
        n=2,
    )
    received = [next(iter(stream)) for _ in range(3)]
    assert all(c.choices[0].text for c in received)
    stream.close()  # the client goes away mid-stream
    free, total = wait_idle(server)
    assert loop.num_aborted == aborted + 2
    assert free == total


# --- load ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_200_concurrent_streaming_clients(server, model, served):
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(8, 128, (int(n),), generator=rng).tolist() for n in range(4, 204)]
    max_tokens = 8

    async def one(client, prompt):
        start, times, pieces = time.perf_counter(), [], []
        stream = await client.completions.create(
            model="course",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                times.append(time.perf_counter() - start)
                pieces.append(choice.text)
        return dict(pieces=pieces, times=times, usage=usage)

    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0, timeout=90
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    started = time.perf_counter()
    results = asyncio.run(run())
    seconds = time.perf_counter() - started
    assert len(results) == 200
    engine = LLMEngine(model, **{**ENGINE, "max_model_len": 512})
    oracle = engine.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    for result, expected in zip(results, oracle):
        assert result["usage"].completion_tokens == max_tokens  # every request completed once
        assert len(result["pieces"]) == max_tokens  # no token lost or duplicated
        assert "".join(result["pieces"]) == " " + served.decode(expected.output_token_ids)
    free, total = wait_idle(server)
    assert free == total
    ttft = [r["times"][0] for r in results]
    tpot = [(r["times"][-1] - r["times"][0]) / (max_tokens - 1) for r in results]

    def pct(values, q):
        return statistics.quantiles(values, n=100)[q - 1] * 1e3

    print(
        f"\n200 streaming clients in {seconds:.1f} s: TTFT p50 {pct(ttft, 50):.0f} ms, "
        f"p99 {pct(ttft, 99):.0f} ms; TPOT p50 {pct(tpot, 50):.1f} ms, p99 {pct(tpot, 99):.1f} ms"
    )


# --- SmolLM2 through the command line ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_smollm2_chat_through_the_command_line():
    """`python -m kvlib.serve --model smollm2` in a subprocess: the chat template, EOS from the
    GGUF metadata, streaming chat; greedy text equal to LLMEngine's on the template's ids; the
    detokenizer on byte-level BPE tokens that split characters."""
    import subprocess
    import sys

    from kvlib.serve.models import load_served_model
    from kvlib.serve.server import free_port

    port = free_port()
    command = [sys.executable, "-m", "kvlib.serve", "--model", "smollm2", "--port", str(port)]
    process = subprocess.Popen(command + ["--num-blocks", "64"], stderr=subprocess.PIPE)
    try:
        served = load_served_model("smollm2")
        tokenizer = served.tokenizer
        text = "🦙 llama, naïve 日本語"
        ids = tokenizer.encode(text)
        assert REPLACEMENT_CHARACTER in "".join(tokenizer.decode([i]) for i in ids)  # the pitfall
        detokenizer = IncrementalDetokenizer(served.decode)
        deltas = [detokenizer.push(i) for i in ids] + [detokenizer.flush()]
        assert "".join(deltas) == text and REPLACEMENT_CHARACTER not in "".join(deltas)

        messages = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        engine = LLMEngine(served.model, num_blocks=64, max_model_len=1024)
        params = SamplingParams(max_tokens=24, stop_token_ids=served.eos_token_ids)
        (expected,) = engine.generate([prompt], params, use_tqdm=False)

        base_url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert process.poll() is None, process.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        r = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0
        )
        assert r.choices[0].message.content == served.decode(expected.output_token_ids)
        finish = "stop" if expected.output_token_ids[-1] in served.eos_token_ids else "length"
        assert r.choices[0].finish_reason == finish
        assert r.usage.prompt_tokens == len(prompt)
        chunks = list(
            client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert streamed == r.choices[0].message.content
    finally:
        process.terminate()
        process.wait(20)


# --- SmolLM2's tokenizer through the server (issue 56, items 1 and 11) --------------------------


class SpecialTokensFirst:
    """SmolLM2's tokenizer over the course model's 128 ids: even ids are SmolLM2's special
    tokens (ids 0-16: `<|endoftext|>`, `<|im_start|>`, ...), odd ids ordinary tokens, so the
    course model's output is text with special tokens in it."""

    chat_template = None

    def __init__(self, smol):
        self.smol = smol

    @staticmethod
    def smol_id(i: int) -> int:
        return i % 17 if i % 2 == 0 else 1000 + i

    def encode(self, text):
        return self.smol.encode(text)

    def decode(self, ids, *, skip_special_tokens=False):
        mapped = [self.smol_id(int(i)) for i in ids]
        return self.smol.decode(mapped, skip_special_tokens=skip_special_tokens)


def test_special_tokens_are_skipped_unless_asked_for(model, smol_tokenizer):
    """vLLM's default `skip_special_tokens=True`: before, `<|im_start|>` and the like were text."""
    tokenizer = SpecialTokensFirst(smol_tokenizer)
    prompt = [1, 2, 9, 42, 2, 11, 44, 60, 61, 62, 3, 9]
    generated = engine_greedy(model, prompt, 12)
    assert any(i % 2 == 0 for i in generated), generated  # some special tokens among them
    served = ServedModel("course", model, tokenizer, (), 1024)
    with serving(served) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        texts = {}
        for skip in (True, False):
            r = client.completions.create(
                model="course",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                extra_body={"skip_special_tokens": skip},
            )
            texts[skip] = r.choices[0].text
        streamed = client.completions.create(
            model="course", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        texts["streamed"] = "".join(c.choices[0].text for c in streamed)
    assert texts[True] == texts["streamed"] == tokenizer.decode(generated, skip_special_tokens=True)
    assert texts[False] == tokenizer.decode(generated) and "<|" in texts[False]
    assert "<|" not in texts[True] and "<repo_name>" not in texts[True]


def test_a_lone_surrogate_is_a_400_naming_the_field_and_keeps_the_connection(model, smol_tokenizer):
    """`"a\\ud800b"` is valid JSON, not valid Unicode text: SmolLM2's tokenizer raised
    "TextInputSequence must be str", a 500 that dropped the keep-alive connection."""
    import http.client

    chat = ServedModel("smollm2", model, smol_tokenizer, (smol_tokenizer.eos_token_id,), 1024)
    with serving(chat) as server:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
        socket = None
        cases = [
            ("/v1/completions", '{"model": "smollm2", "prompt": "a\\ud800b"}', "prompt"),
            ("/v1/completions", '{"model": "smollm2", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
            (
                "/v1/chat/completions",
                '{"model": "smollm2", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
                "messages.0.content",
            ),
            (
                "/v1/chat/completions",
                '{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], '
                '"stop": ["\\ud800"]}',
                "stop.0",
            ),
        ]
        for path, body, param in cases:
            connection.request("POST", path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            error = json.loads(response.read())["error"]
            assert response.status == 400 and error["param"] == param, (path, body, error)
            assert not response.will_close and connection.sock is (socket or connection.sock)
            socket = connection.sock
        connection.close()


def test_smollm2_min_tokens_is_its_longest_token_and_a_lower_bound(smol_tokenizer):
    """`min_tokens` divides a text's UTF-8 bytes by the longest token's bytes (81: a newline and
    80 spaces), read from the vocabulary; no text tokenizes into fewer tokens, the texts made of
    SmolLM2's longest tokens included (where the bound is tight)."""
    from kvlib.serve.logprobs import token_bytes

    size = smol_tokenizer.backend.get_vocab_size()
    longest = max(len(token_bytes(smol_tokenizer, i)) for i in range(size))
    assert smol_tokenizer.max_token_bytes == longest == 81
    tight = "\n" + " " * 80
    assert len(smol_tokenizer.encode(tight)) == smol_tokenizer.min_tokens(tight) == 1

    pieces = st.sampled_from(["#" * 80, "\n" + " " * 80, " =" * 33, "<|im_start|>", "é", "1", " a"])
    texts = st.one_of(st.text(max_size=400), st.lists(pieces, max_size=40).map("".join))

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(texts)
    def bound_holds(text):
        assert smol_tokenizer.min_tokens(text) <= len(smol_tokenizer.encode(text)), text

    bound_holds()


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(model, smol_tokenizer):
    """A text whose bytes alone need more tokens than the context holds is a 400
    (context_length_exceeded) from its length bound: the tokenizer is never called with it (before,
    every text up to the 2 MiB body limit was tokenized first, about 0.7 s per MB here); a text
    within the bound is tokenized and checked exactly as before."""

    class Counting:
        def __init__(self, tokenizer):
            self.tokenizer, self.texts = tokenizer, []
            self.chat_template = tokenizer.chat_template
            self.eos_token_id, self.min_tokens = tokenizer.eos_token_id, tokenizer.min_tokens

        def encode(self, text):
            self.texts.append(text)
            return [i % 128 for i in self.tokenizer.encode(text)]  # course-model ids

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return self.encode(self.tokenizer.render_chat(messages, add_generation_prompt))

        def decode(self, ids, *, skip_special_tokens=False):
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    tokenizer = Counting(smol_tokenizer)
    chat = ServedModel("smollm2", model, tokenizer, (smol_tokenizer.eos_token_id,), 1024)
    long = "#" * (81 * 512)  # 512 tokens at the least: no room in 512 for a completion token
    with serving(chat) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        for call in (
            lambda: client.completions.create(model="smollm2", prompt=long),
            lambda: client.completions.create(model="smollm2", prompt=["hi", long]),
            lambda: client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": long}]
            ),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                call()
            error = refused.value.body
            assert error["code"] == "context_length_exceeded", error
            assert "at least 512 tokens (not tokenized)" in error["message"], error
        assert long not in tokenizer.texts and not any(long in t for t in tokenizer.texts)
        near = "#" * (81 * 10)  # at least 10 tokens by the bound; more in fact
        n = len(smol_tokenizer.encode(near))
        with pytest.raises(openai.BadRequestError) as exact:
            client.completions.create(model="smollm2", prompt=near, max_tokens=502)
        assert near in tokenizer.texts  # tokenized: the bound (10 + 502 <= 512) let it through
        assert (
            n + 502 > 512
            and f"needs {n} prompt tokens + 502 completion" in exact.value.body["message"]
        )
