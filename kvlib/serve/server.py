"""An OpenAI-compatible HTTP server over `LLMEngine` (chapter 13): FastAPI routes, server-sent
events, errors; the engine runs in an `EngineLoop` thread.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`. A request is
checked (body, model name, prompt length) before it reaches the engine; each of its choices
becomes one engine request whose outputs come back through an `asyncio.Queue`, fed from the engine
thread by `loop.call_soon_threadsafe`. `stream: true` answers with server-sent events, one
`data: {json}` per chunk and `data: [DONE]` last; a client that disconnects mid-stream cancels the
response, and its `finally` aborts the engine requests (their blocks are freed). Unseeded requests
get a fresh random seed (OpenAI's and vLLM's behaviour); choice i of a request uses seed + i.

What it deliberately does not do: authentication, batched chat, tools, penalties, `echo`,
`best_of` > n (refused with a 400 naming the field).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from kvlib.engine import LLMEngine, SamplingParams
from kvlib.serve.api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from kvlib.serve.choices import Choice
from kvlib.serve.engine_loop import EngineLoop, QueueFullError
from kvlib.serve.models import ServedModel

__all__ = ["ServerThread", "create_app", "free_port"]


def create_app(served: ServedModel, engine: LLMEngine, *, max_queued_requests: int = 256):
    """The FastAPI app serving `served` through `engine` (started on the app's startup, stopped on
    its shutdown). `app.state.loop` is the `EngineLoop`."""
    loop = EngineLoop(engine, max_queued_requests=max_queued_requests)
    app = FastAPI(title="kvlib server", lifespan=_lifespan(loop))
    app.state.loop, app.state.served = loop, served

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvlib",
                    "max_model_len": engine.config.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        _check_model(body.model, served)
        body.check_unsupported()
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
        prompts = _prompt_token_ids(body.prompt, served)
        max_tokens = body.max_tokens
        job = _Job(loop, served, engine, body, prompts, max_tokens, "prompt", body.logprobs)
        return await job.respond(chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        _check_model(body.model, served)
        body.check_unsupported()
        if not served.has_chat_template:
            raise APIError(
                400, f"messages: model {served.name!r} has no chat template", param="messages"
            )
        messages = [m.model_dump() for m in body.messages]
        prompt = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        max_tokens = body.max_completion_tokens or body.max_tokens
        job = _Job(loop, served, engine, body, [prompt], max_tokens, "messages", None)
        return await job.respond(chat=True)

    return app


def _lifespan(loop: EngineLoop):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.stop()

    return lifespan


def _check_model(name: str, served: ServedModel) -> None:
    if name != served.name:
        raise APIError(
            404,
            f"model: {name!r} does not exist; this server serves {served.name!r}",
            param="model",
            code="model_not_found",
        )


def _prompt_token_ids(prompt, served: ServedModel) -> list[list[int]]:
    """A completion's prompt (text, ids, or a list of either) as lists of token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: expected at least one prompt", param="prompt")
    vocab = served.model.config.vocab_size
    prompts = []
    for item in prompt:
        try:
            ids = served.tokenizer.encode(item) if isinstance(item, str) else list(item)
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        if not ids:
            raise APIError(400, "prompt: expected at least one token", param="prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        prompts.append(ids)
    return prompts


class _Job:
    """One HTTP request: its prompts x n choices, their engine requests and their responses."""

    def __init__(self, loop, served, engine, body, prompts, max_tokens, prompt_field, logprobs):
        self.loop, self.served, self.body, self.prompts = loop, served, body, prompts
        self.id = f"{'chatcmpl' if prompt_field == 'messages' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        limit, block_size = engine.config.max_model_len, engine.config.block_size
        stop, seed = body.stop_strings(), body.seed
        seed = secrets.randbelow(2**31) if seed is None else seed
        self.choices, self.submissions = [], []
        for p, ids in enumerate(prompts):
            tokens = max_tokens if max_tokens is not None else limit - len(ids)
            if len(ids) + tokens > limit or tokens < 1:
                raise APIError(
                    400,
                    f"{prompt_field}: this model's maximum context length is {limit} tokens; "
                    f"the request needs {len(ids)} prompt tokens + {tokens} completion tokens",
                    param=prompt_field,
                    code="context_length_exceeded",
                )
            if -(-(len(ids) + tokens - 1) // block_size) > engine.config.num_blocks:
                raise APIError(
                    400,
                    f"{prompt_field}: {len(ids)} + {tokens} tokens need more KV blocks than "
                    f"this server's {engine.config.num_blocks}",
                    param=prompt_field,
                    code="context_length_exceeded",
                )
            ids_here, params = [], []
            for j in range(body.n):
                index = p * body.n + j
                choice = Choice(f"{self.id}-{index}", index, served, ids, stop, logprobs)
                self.choices.append(choice)
                ids_here.append(choice.request_id)
                params.append(
                    SamplingParams(
                        temperature=body.temperature if body.temperature is not None else 1.0,
                        top_p=body.top_p,
                        top_k=None if body.top_k in (None, -1, 0) else body.top_k,
                        seed=(seed + j) % 2**63,
                        max_tokens=tokens,
                        stop_token_ids=served.eos_token_ids,
                        logprobs=logprobs,
                    )
                )
            self.submissions.append((ids_here, ids, params))
        self.by_id = {c.request_id: c for c in self.choices}
        self.chat = prompt_field == "messages"

    async def respond(self, *, chat: bool):
        events: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(item, _put=events.put_nowait):
            event_loop.call_soon_threadsafe(_put, item)

        submitted = []
        try:
            for request_ids, ids, params in self.submissions:
                self.loop.submit(request_ids, ids, params, sink)
                submitted += request_ids
        except QueueFullError as error:
            self.loop.abort(submitted)
            raise APIError(429, str(error), type="rate_limit_error", code="queue_full") from None
        if self.body.stream:
            return StreamingResponse(self._stream(events), media_type="text/event-stream")
        try:
            async for _ in self._updates(events):
                pass
        finally:
            self._abort_unfinished()
        return self._response()

    async def _updates(self, events: asyncio.Queue):
        """Yield (choice, text delta) until every choice has finished."""
        while not all(c.finished for c in self.choices):
            item = await events.get()
            if isinstance(item, ValueError | TypeError):  # the engine refused the request
                raise APIError(400, str(item), param="prompt")
            if isinstance(item, Exception):  # a step failed: the server's fault, not the client's
                raise APIError(500, str(item), type="server_error")
            choice = self.by_id[item.request_id]
            delta = choice.accept(item)
            if choice.needs_abort:
                choice.needs_abort = False
                self.loop.abort([choice.request_id])
            yield choice, delta

    def _abort_unfinished(self) -> None:
        unfinished = [c.request_id for c in self.choices if not c.finished]
        if unfinished:
            self.loop.abort(unfinished)

    async def _stream(self, events: asyncio.Queue):
        try:
            if self.chat:
                for choice in self.choices:
                    yield _sse(self._chunk(choice, {"role": "assistant", "content": ""}))
            sent = {c.request_id: 0 for c in self.choices}
            async for choice, delta in self._updates(events):
                if not delta and not choice.finished:
                    continue
                piece = {"content": delta} if self.chat else delta
                logprobs = None
                if not self.chat and choice.logprobs is not None:
                    logprobs = choice.completion_logprobs(sent[choice.request_id])
                    sent[choice.request_id] = len(choice.token_logprobs)
                yield _sse(self._chunk(choice, piece, choice.finish_reason, logprobs))
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield _sse({**self._header(chunk=True), "choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        except APIError as error:  # refused after the stream started: an error event
            yield _sse(error.body())
        finally:  # also when the client disconnected (the response was cancelled)
            self._abort_unfinished()

    def _header(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        kind += ".chunk" if chunk and self.chat else ""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served.name}

    def _chunk(self, choice, piece, finish_reason=None, logprobs=None) -> dict:
        body = {"index": choice.index, "finish_reason": finish_reason, "logprobs": logprobs}
        body["delta" if self.chat else "text"] = piece
        return {**self._header(chunk=True), "choices": [body]}

    def _usage(self) -> dict:
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _response(self) -> dict:
        choices = []
        for c in self.choices:
            body = {"index": c.index, "finish_reason": c.finish_reason}
            if self.chat:
                body.update(message={"role": "assistant", "content": c.text}, logprobs=None)
            else:
                body.update(text=c.text, logprobs=c.completion_logprobs())
            choices.append(body)
        return {**self._header(chunk=False), "choices": choices, "usage": self._usage()}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """Serve `app` with uvicorn in a background thread (tests, notebooks): `start()` returns once
    it accepts connections; `stop()` shuts it down (the app's engine loop with it). Also a
    context manager. `base_url` is `http://host:port/v1`, what the openai client takes."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="kvlib-server", daemon=True)
        self.app = app

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
