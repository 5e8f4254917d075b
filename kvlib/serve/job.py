"""One HTTP request's life in the server (chapter 13): its choices, their engine requests, the
response (collected, or streamed as server-sent events), aborts and metrics.

A `Job` is built from a checked request body: one `Choice` per (prompt, n) pair, each an engine
request with its own `SamplingParams` (choice i of a prompt seeded with seed + i). `respond`
submits them to the `EngineLoop` and either returns a `StreamingResponse` whose generator yields
`data: {json}` chunks, or collects every choice into one response while watching the connection:
if the client leaves first (`http.disconnect`, vLLM's `listen_for_disconnect`), the collection is
cancelled. Whichever way the job ends (finished, client gone, a failed step, the server shutting
down), the engine requests of unfinished choices are aborted, so their blocks are freed at once,
and each choice is counted once in the server's metrics by how it ended.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvlib.engine import SamplingParams
from kvlib.serve.api import APIError
from kvlib.serve.choices import Choice
from kvlib.serve.engine_loop import EngineDeadError, QueueFullError, Scheduled

__all__ = ["RETRY_AFTER_S", "Job"]

RETRY_AFTER_S = 1  # a 429's Retry-After (s): the queue drains as requests finish


class Job:
    """One HTTP request: its prompts x n choices, their engine requests and their responses."""

    def __init__(self, app, engine, body, prompts, max_tokens, prompt_field, logprobs):
        self.arrival_s = time.perf_counter()  # the server's clock for TTFT and latency metrics
        self.loop, self.metrics = app.state.loop, app.state.metrics
        self.served, self.body, self.prompts = app.state.served, body, prompts
        self.id = f"{'chatcmpl' if prompt_field == 'messages' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        limit, block_size = engine.config.max_model_len, engine.config.block_size
        stop, seed = body.stop_strings(), body.seed
        seed = secrets.randbelow(2**31) if seed is None else seed
        queue_limit = app.state.loop.max_queued_requests
        if len(prompts) * body.n > queue_limit:  # can never fit: not worth a retry (429)
            param = "n" if body.n > 1 else prompt_field
            raise APIError(
                400,
                f"{param}: {len(prompts)} prompts x n = {body.n} make {len(prompts) * body.n} "
                f"requests; this server queues at most {queue_limit}",
                param=param,
            )
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
                choice = Choice(
                    f"{self.id}-{index}",
                    index,
                    self.served,
                    ids,
                    stop,
                    logprobs,
                    skip_special_tokens=body.skip_special_tokens,
                )
                self.choices.append(choice)
                ids_here.append(choice.request_id)
                params.append(
                    SamplingParams(
                        temperature=body.temperature if body.temperature is not None else 1.0,
                        top_p=body.top_p,
                        top_k=None if body.top_k in (None, -1, 0) else body.top_k,
                        seed=(seed + j) % 2**63,
                        max_tokens=tokens,
                        stop_token_ids=self.served.eos_token_ids,
                        logprobs=logprobs,
                    )
                )
            self.submissions.append((ids_here, ids, params))
        self.by_id = {c.request_id: c for c in self.choices}
        self.chat = prompt_field == "messages"
        self.ended: set[str] = set()  # choices counted in the metrics
        self.outcome = "abort"  # what an unfinished choice counts as: abort, error, or refused

    async def respond(self, request: Request):
        events: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(item, _put=events.put_nowait):
            event_loop.call_soon_threadsafe(_put, item)

        submitted = []
        try:
            for request_ids, ids, params in self.submissions:
                self.loop.submit(request_ids, ids, params, sink)
                submitted += request_ids
        except QueueFullError as error:  # transient: the client may retry after a while
            self.loop.abort(submitted)
            raise APIError(
                429,
                str(error),
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except EngineDeadError as error:
            self.loop.abort(submitted)
            raise APIError(503, str(error), type="server_error") from None
        if self.body.stream:
            return StreamingResponse(self._stream(events), media_type="text/event-stream")
        collecting = asyncio.ensure_future(self._collect(events))
        leaving = asyncio.ensure_future(_client_gone(request))
        try:
            done, _ = await asyncio.wait((collecting, leaving), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled (the server shuts down)
            leaving.cancel()
            if not collecting.done():
                collecting.cancel()
            self._abort_unfinished()
        if collecting not in done:  # the client left first: nobody to answer
            return Response(status_code=499)  # nginx's "client closed request"
        return collecting.result()  # the response, or the APIError that ended the collection

    async def _collect(self, events: asyncio.Queue) -> dict:
        async for _ in self._updates(events):
            pass
        return self._response()

    async def _updates(self, events: asyncio.Queue):
        """Yield (choice, text delta) until every choice has finished."""
        while not all(c.finished for c in self.choices):
            item = await events.get()
            if isinstance(item, Scheduled):  # its first step ended: the end of its queue time
                self.by_id[item.request_id].scheduled_s = item.time_s
                continue
            if isinstance(item, ValueError | TypeError):  # the engine refused the request
                self.outcome = "refused"
                raise APIError(400, str(item), param="prompt")
            if isinstance(item, EngineDeadError):
                self.outcome = "error"
                raise APIError(503, str(item), type="server_error")
            if isinstance(item, Exception):  # a step failed: the server's fault, not the client's
                self.outcome = "error"
                raise APIError(500, str(item), type="server_error")
            choice = self.by_id[item.request_id]
            if choice.finished:  # tokens after a stop string, before its abort landed
                continue
            delta = choice.accept(item)
            self._observe(choice, time.perf_counter())
            if choice.needs_abort:
                choice.needs_abort = False
                self.loop.abort([choice.request_id])
            yield choice, delta

    def _observe(self, choice: Choice, now: float) -> None:
        """Token and latency metrics for the tokens `choice` just counted."""
        new_tokens = len(choice.token_ids) - choice.num_observed
        choice.num_observed = len(choice.token_ids)
        if choice.first_token_s is None:
            choice.first_token_s = now
            prompt_tokens = len(choice.prompt_token_ids)
            self.metrics.first_token(now - self.arrival_s, prompt_tokens, new_tokens)
        else:
            self.metrics.next_token(now - choice.last_token_s, new_tokens)
        choice.last_token_s = now
        if choice.finished:
            self._end(choice, choice.finish_reason, now)

    def _end(self, choice: Choice, reason: str, now: float) -> None:
        if choice.request_id in self.ended:
            return
        self.ended.add(choice.request_id)
        first, last, scheduled = choice.first_token_s, choice.last_token_s, choice.scheduled_s
        span = None if first is None else last - first
        self.metrics.finished(
            reason,
            now - self.arrival_s,
            len(choice.token_ids),
            span,
            prompt_tokens=len(choice.prompt_token_ids),
            queue_s=None if scheduled is None else max(0.0, scheduled - self.arrival_s),
            prefill_s=None if scheduled is None or first is None else max(0.0, first - scheduled),
        )

    def _abort_unfinished(self) -> None:
        """Abort the engine requests of the choices that have not finished; count them (abort:
        the client left; error: a failed step; a request `add` refused is not counted)."""
        unfinished = [c for c in self.choices if not c.finished]
        if not unfinished:
            return
        self.loop.abort([c.request_id for c in unfinished])
        if self.outcome != "refused":
            now = time.perf_counter()
            for choice in unfinished:
                self._end(choice, self.outcome, now)

    async def _stream(self, events: asyncio.Queue):
        usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        try:
            if self.chat:
                for choice in self.choices:
                    chunk = self._chunk(choice, {"role": "assistant", "content": ""})
                    yield _sse({**chunk, "usage": None} if usage else chunk)
            sent = {c.request_id: 0 for c in self.choices}
            async for choice, delta in self._updates(events):
                if not delta and not choice.finished:
                    continue
                piece = {"content": delta} if self.chat else delta
                logprobs = None
                if not self.chat and choice.logprobs is not None:
                    logprobs = choice.completion_logprobs(sent[choice.request_id])
                    sent[choice.request_id] = len(choice.token_logprobs)
                chunk = self._chunk(choice, piece, choice.finish_reason, logprobs)
                yield _sse({**chunk, "usage": None} if usage else chunk)  # OpenAI: null until last
            if usage:
                yield _sse({**self._header(chunk=True), "choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        except APIError as error:  # refused after the stream started: an error event, then DONE
            yield _sse(error.body())
            yield "data: [DONE]\n\n"
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


async def _client_gone(request: Request) -> None:
    """Return once the client has closed its connection. The request's body has been read, so
    the next message on its receive channel is the ASGI server's `http.disconnect`, sent when the
    connection drops (or after the response was sent). A receive channel that fails tells
    nothing: then wait (until cancelled) and let the response decide."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        await asyncio.Future()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
