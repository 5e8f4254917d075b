"""An OpenAI-compatible HTTP server over `LLMEngine` (chapter 13): FastAPI routes, server-sent
events, errors; the engine runs in an `EngineLoop` thread.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`; `GET /openapi.json`
(the document as the server behaves: `kvlib.serve.openapi`); `GET /health`
(200 while the engine loop lives, 503 once it died) and `GET /metrics` (Prometheus' text format,
vLLM's names: `kvlib.serve.metrics`). A request is checked (body, model name, prompt length)
before it reaches the engine; each of its choices becomes one engine request whose outputs come
back through an `asyncio.Queue`, fed from the engine thread by `loop.call_soon_threadsafe`.
`stream: true` answers with server-sent events, one `data: {json}` per chunk and `data: [DONE]`
last. Every error has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: a bad
field (400, `param` names it), invalid JSON (400), an unknown route (404), a wrong method (405),
a missing or wrong API key (401, with `api_key` set: `kvlib.serve.auth`), a body over
`max_body_bytes` (413, before it is read), a request whose choices alone exceed the queue (400),
a queue full for now (429 with `Retry-After`), a failed engine step (500; in a stream that
already started, a `data: {"error": ...}` event, then `data: [DONE]`). Tokenization runs in a
worker thread, so a long prompt never stalls the event loop (other streams, `/health`).

A client that leaves is noticed either way, and its engine requests are aborted (their blocks
freed at once): a stream's response is cancelled and its `finally` aborts; a non-streamed request
is raced against the connection's `http.disconnect` message (vLLM's `listen_for_disconnect`),
and whichever ends first cancels the other. Unseeded requests get a fresh random seed (OpenAI's
and vLLM's behaviour); choice i of a request uses seed + i.

What it deliberately does not do: batched chat, tools, penalties, `echo`, `best_of` > n
(refused with a 400 naming the field).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from kvlib.engine import LLMEngine
from kvlib.serve.api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    unencodable_field,
    validation_error,
)
from kvlib.serve.auth import BearerAuth, check_api_key, check_bind
from kvlib.serve.engine_loop import EngineLoop
from kvlib.serve.job import Job
from kvlib.serve.metrics import CONTENT_TYPE, ServerMetrics
from kvlib.serve.models import ServedModel
from kvlib.serve.openapi import true_openapi

__all__ = ["MAX_BODY_BYTES", "BodyLimit", "ServerThread", "create_app", "free_port"]

MAX_BODY_BYTES = 2**21  # 2 MiB: far above any prompt a 8k-token context takes, as text or ids


def create_app(
    served: ServedModel,
    engine: LLMEngine,
    *,
    max_queued_requests: int = 256,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
):
    """The FastAPI app serving `served` through `engine` (started on the app's startup, stopped on
    its shutdown). `app.state.loop` is the `EngineLoop`, `app.state.metrics` its `ServerMetrics`;
    with `api_key`, `/v1/*` requires `Authorization: Bearer api_key` (`kvlib.serve.auth`); a
    request body over `max_body_bytes` bytes is refused with a 413.

    Raises:
        ValueError, TypeError: an empty or non-str `api_key`, a `max_body_bytes` not an int >= 1.
    """
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
        raise TypeError(f"max_body_bytes: expected an int, got {max_body_bytes!r}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: expected an int >= 1, got {max_body_bytes}")
    metrics = ServerMetrics(served.name, lambda: loop.snapshot)
    loop = EngineLoop(engine, max_queued_requests=max_queued_requests, step_observer=metrics.step)
    app = FastAPI(title="kvlib server", lifespan=_lifespan(loop))
    app.state.loop, app.state.served, app.state.metrics = loop, served, metrics
    app.state.api_key = api_key
    if api_key is not None:
        check_api_key(api_key)  # now, not when the middleware is built at the first request
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)  # outermost: before the key
    _add_error_handlers(app)

    def openapi():  # the document as the server behaves (kvlib.serve.openapi), built once
        if app.openapi_schema is None:
            app.openapi_schema = true_openapi(
                app,
                model_name=served.name,
                vocab_size=served.model.config.vocab_size,
                keyed=api_key is not None,
            )
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health")
    async def health():
        if not loop.is_alive:
            raise APIError(
                503, f"the engine loop is not running ({loop.error!r})", type="server_error"
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

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
    async def completions(body: CompletionRequest, request: Request):
        _check_body(body, served)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
        completion = 1 if body.max_tokens is None else body.max_tokens
        limit = engine.config.max_model_len
        prompts = await asyncio.to_thread(_prompt_token_ids, body.prompt, served, limit, completion)
        job = Job(app, engine, body, prompts, body.max_tokens, "prompt", body.logprobs)
        return await job.respond(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_body(body, served)
        body.check_tools()
        if not served.has_chat_template:
            raise APIError(
                400, f"messages: model {served.name!r} has no chat template", param="messages"
            )
        messages = [m.for_template() for m in body.messages]
        max_tokens = body.max_completion_tokens or body.max_tokens
        contents = "".join(m["content"] or "" for m in messages)  # the template only adds text
        _check_length(contents, served, engine.config.max_model_len, max_tokens or 1, "messages")
        prompt = await asyncio.to_thread(_chat_token_ids, messages, served)
        job = Job(app, engine, body, [prompt], max_tokens, "messages", None)
        return await job.respond(request)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape (see the module docstring), FastAPI's own included."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)  # the router's 404 (no route) and 405 (wrong method)
    async def _http_error(request: Request, exc: HTTPException):
        what = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, exc.detail)
        allowed = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow")
        message = f"{request.method} {request.url.path}: {what}"
        message += f" (this route takes {allowed})" if allowed else ""
        error = APIError(exc.status_code, message)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)  # a bug: a 500 in OpenAI's shape, never a stack trace
    async def _bug(request: Request, exc: Exception):
        error = APIError(500, f"internal server error: {exc!r}", type="server_error")
        return JSONResponse(error.body(), status_code=500)


def _lifespan(loop: EngineLoop):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.stop()

    return lifespan


def _check_body(body, served: ServedModel) -> None:
    """The model's name, fields at neutral values only, text UTF-8 can encode."""
    _check_model(body.model, served)
    body.check_unsupported()
    field = unencodable_field(body.model_dump(exclude_defaults=True))
    if field is not None:
        raise APIError(
            400,
            f"{field}: not valid Unicode text (a lone surrogate such as \\ud800?)",
            param=field,
        )


def _chat_token_ids(messages: list[dict], served: ServedModel) -> list[int]:
    """The chat template's token ids (in a worker thread); a tokenizer error is a 400."""
    try:
        return served.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as error:  # the text is the client's: a 400, never a 500
        raise APIError(
            400, f"messages: could not be tokenized ({error})", param="messages"
        ) from None


def _check_model(name: str, served: ServedModel) -> None:
    if name != served.name:
        raise APIError(
            404,
            f"model: {name!r} does not exist; this server serves {served.name!r}",
            param="model",
            code="model_not_found",
        )


def _check_length(text: str, served: ServedModel, limit: int, completion: int, field: str) -> None:
    """Refuse a text whose tokens cannot fit the context with `completion` tokens after them,
    before tokenizing it: the tokenizer's `min_tokens` is a lower bound on its token count, so
    only a request that would fail anyway is refused (400, context_length_exceeded), at the cost
    of counting its bytes instead of tokenizing up to the 2 MiB a body may hold."""
    bound = getattr(served.tokenizer, "min_tokens", None)
    at_least = bound(text) if bound is not None else 0
    if at_least + completion > limit:
        raise APIError(
            400,
            f"{field}: this model's maximum context length is {limit} tokens; the text alone is "
            f"at least {at_least} tokens (not tokenized) + {completion} completion tokens",
            param=field,
            code="context_length_exceeded",
        )


def _prompt_token_ids(prompt, served: ServedModel, limit: int, completion: int) -> list[list[int]]:
    """A completion's prompt (text, ids, or a list of either) as lists of token ids; a text that
    cannot fit `limit` tokens with `completion` after it is refused before it is tokenized."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: expected at least one prompt", param="prompt")
    vocab = served.model.config.vocab_size
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            _check_length(item, served, limit, completion, "prompt")
        try:
            ids = served.tokenizer.encode(item) if isinstance(item, str) else list(item)
        except ValueError as error:  # the course tokenizer's message names the field
            raise APIError(400, str(error), param="prompt") from None
        except Exception as error:  # the text is the client's: a 400, never a 500
            message = f"prompt: could not be tokenized ({error})"
            raise APIError(400, message, param="prompt") from None
        if not ids:
            raise APIError(400, "prompt: expected at least one token", param="prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        prompts.append(ids)
    return prompts


class BodyLimit:
    """ASGI middleware: a request body over `max_body_bytes` gets a 413 in OpenAI's shape, from its
    `Content-Length` before any of it is read, or once a chunked body passes the limit. The body
    is read here and replayed to the app, then the client's own messages follow (the server
    watches them for `http.disconnect`)."""

    def __init__(self, app, max_body_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"").decode("latin-1").strip()
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._refuse(send, int(declared))
        received, size = [], 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await self._refuse(send, size)
            if not message.get("more_body", False):
                break

        async def replay():
            return received.pop(0) if received else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int) -> None:
        message = (
            f"the request body: {size} bytes{' or more' if size <= self.max_body_bytes else ''}"
            f" exceed this server's limit of {self.max_body_bytes} bytes"
        )
        body = json.dumps(error_body(message, code="request_too_large")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """Serve `app` with uvicorn in a background thread (tests, notebooks): `start()` returns once
    it accepts connections; `stop()` shuts it down (the app's engine loop with it). Also a
    context manager. `base_url` is `http://host:port/v1`, what the openai client takes;
    `root_url` is `http://host:port` (`/health`, `/metrics`).

    Raises:
        PermissionError: a `host` beyond loopback for an app without an API key, unless
            `allow_no_auth` (`kvlib.serve.auth.check_bind`).
    """

    def __init__(
        self,
        app,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        allow_no_auth: bool = False,
    ):
        import uvicorn

        check_bind(host, getattr(app.state, "api_key", None), allow_no_auth)
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="kvlib-server", daemon=True)
        self.app = app

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

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
