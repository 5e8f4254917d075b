"""The engine in one background thread (chapter 13), fed by a thread-safe queue.

`LLMEngine` is not thread-safe and need not be: only `EngineLoop`'s thread ever touches it. Other
threads (the web server's event loop) talk to it through `inbox`, a `queue.SimpleQueue` of
commands (add requests, abort requests, run a function between steps), and get tokens back
through a *sink* per request: a callable the loop calls, from its thread, with each
`RequestOutput` or with the exception that refused the request. The web server's sinks hop
back onto its event loop (`loop.call_soon_threadsafe`).

The loop: take every waiting command (blocking briefly when the engine is idle), run one
`engine.step()`, hand each output to its request's sink, repeat. A bad request is refused by its
own `add` (its sink gets the `ValueError`); an exception inside `step()` (a bug) fails the
requests in flight, never the loop. An exception anywhere else in the loop (a bug in the loop
itself) ends it: every request in flight and every command still queued gets `EngineDeadError`,
`submit` refuses new requests with it, and `is_alive` turns False (the server's `/health` answers
503, as vLLM's does once its engine core died).

After every step and every batch of commands, the loop's thread publishes an `EngineSnapshot`
(requests running and waiting, KV blocks in use, preemptions and prefix-cache lookups so far):
what `/metrics` reports, read by other threads without touching the engine. It reads the step's
`StepStats` record (`kvlib.engine.stats`), never the engine's private state; it hands each
step's record to `step_observer` (the server's per-step histogram) and, before a step's
outputs, sends a request's sink `Scheduled(request_id, time_s)` the first time a step computed
its tokens (the end of its queue time). What it deliberately does not do: text
(detokenization and stop strings are the server's, per choice).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kvlib.engine import LLMEngine, SamplingParams, SpecDecodingStats

__all__ = [
    "EngineDeadError",
    "EngineLoop",
    "EngineSnapshot",
    "EngineStepError",
    "QueueFullError",
    "Scheduled",
]

_log = logging.getLogger("kvlib.serve")


class QueueFullError(RuntimeError):
    """More requests in flight than `max_queued_requests`: the server answers 429."""


class EngineStepError(RuntimeError):
    """A step raised (a bug, whatever its exception type): the server answers 500, never the
    400 it sends when `add` refused the request itself."""


class EngineDeadError(RuntimeError):
    """The loop's thread ended on an exception (or was stopped): nothing more will be served; the
    server answers 503."""


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """A request's first step: `time_s` (`time.perf_counter()`) when that step ended."""

    request_id: str
    time_s: float


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after the loop's latest step or commands (published by its thread):
    requests running and waiting in the scheduler, KV blocks in use of `num_blocks` (blocks no
    request holds count as free, cached for prefix hits or not: vLLM's `kv_cache_usage_perc`),
    preemptions since the start, and the prefix cache's lookups since the start (tokens looked
    up and tokens found, of requests admitted for the first time: vLLM's queries and hits);
    with speculative decoding on, a copy of the engine's `SpecDecodingStats` (None: off)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_in_use: int = 0
    num_blocks: int = 1
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decoding: SpecDecodingStats | None = None

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's blocks in use, in [0, 1]."""
        return self.num_blocks_in_use / self.num_blocks


class EngineLoop:
    """Runs `engine` in a daemon thread (see the module docstring).

    Args:
        engine: the `LLMEngine`; only this loop's thread may touch it once `start()` is called.
        max_queued_requests: requests (choices) accepted and not finished, at most: `submit`
            raises `QueueFullError` beyond it.
        step_observer: called in the loop's thread with each step's `StepStats` (or None).
    """

    IDLE_WAIT_S = 0.05  # how long an idle loop blocks on its inbox before checking `stop`

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_queued_requests: int = 256,
        step_observer: Callable | None = None,
    ):
        self.engine = engine
        self.step_observer = step_observer
        self._scheduled: set[str] = set()  # requests a step has computed (engine thread only)
        self.max_queued_requests = max_queued_requests
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, Callable] = {}  # engine thread only
        self._lock = threading.Lock()
        self.num_in_flight = 0  # accepted, not finished or aborted (guarded by _lock)
        self.num_finished = self.num_aborted = self.num_step_errors = 0
        self.snapshot = EngineSnapshot(num_blocks=engine.config.num_blocks)
        self.error: BaseException | None = None  # what ended the loop's thread, if anything
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvlib-engine-loop", daemon=True)

    # --- any thread ------------------------------------------------------------------------------

    def start(self) -> EngineLoop:
        self.thread.start()
        return self

    @property
    def is_alive(self) -> bool:
        """True while the loop's thread runs and has not been asked to stop."""
        return self.thread.is_alive() and not self._stopping.is_set() and self.error is None

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout_s)

    def submit(
        self,
        request_ids: Sequence[str],
        prompt_token_ids: Sequence[int],
        sampling_params: Sequence[SamplingParams],
        sink: Callable,
    ) -> None:
        """Queue one prompt's choices (several: parallel sampling, forked after the prefill).

        Raises:
            QueueFullError: the loop already holds `max_queued_requests` requests.
            EngineDeadError: the loop's thread has ended (see `error`).
        """
        self._check_alive()
        with self._lock:
            if self.num_in_flight + len(request_ids) > self.max_queued_requests:
                raise QueueFullError(
                    f"{self.num_in_flight} requests in flight; this server queues at most "
                    f"{self.max_queued_requests}"
                )
            self.num_in_flight += len(request_ids)
        self._put(("add", list(request_ids), list(prompt_token_ids), sampling_params, sink))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (a client went away, or a stop string ended them): their blocks are
        freed before the next step. Unknown or finished ids are ignored."""
        self.inbox.put(("abort", list(request_ids)))

    def call(self, function: Callable[[LLMEngine], object], timeout_s: float = 30.0):
        """Run `function(engine)` in the loop's thread between two steps; return its result
        (tests read the allocator this way, never while a step runs)."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", function, future))
        return future.result(timeout_s)

    def _check_alive(self) -> None:
        if self.error is not None or self._stopping.is_set():
            raise EngineDeadError(f"the engine loop is not running (it ended on {self.error!r})")

    def _put(self, command: tuple) -> None:
        self.inbox.put(command)
        if self.error is not None:  # it died while this was queued: nobody will drain the inbox
            self._fail_everything(EngineDeadError(f"the engine loop died: {self.error!r}"))

    # --- the loop's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_unfinished_requests())
                self._publish(None)
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # a bug in the loop itself: nothing more is served
            self.error = error
            _log.exception("the engine loop died")
            self._fail_everything(EngineDeadError(f"the engine loop died: {error!r}"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # a bug in a step: fail what is in flight, keep serving
            self.num_step_errors += 1
            failure = EngineStepError(f"an engine step failed: {error!r}")
            for request_id in list(self.sinks):
                self._finish(request_id, aborted=True, notify=failure)
            return
        record = _last_step(self.engine)
        self._publish(record)
        self._observe(record)  # metrics: the step's tokens, requests it scheduled first
        for output in outputs:
            sink = self.sinks.get(output.request_id)
            if sink is not None:
                _deliver(sink, output)
            if output.finished:
                self._finish(output.request_id, aborted=False)

    def _observe(self, record) -> None:
        """Hand the step's `StepStats` to `step_observer`; tell the sink of each request this
        step computed for the first time (`Scheduled`), before the step's outputs."""
        if self.step_observer is not None:
            self.step_observer(record)
        now = time.perf_counter()
        for request_id, _ in record.scheduled:
            sink = self.sinks.get(request_id)
            if sink is not None and request_id not in self._scheduled:
                self._scheduled.add(request_id)
                _deliver(sink, Scheduled(request_id, now))

    def _publish(self, record) -> None:
        """Replace `snapshot` (one reference assignment: readers see the old or the new one),
        adding the counts of `record`, the step's `StepStats` (None: no step ran)."""
        scheduler, old = self.engine.scheduler, self.snapshot
        spec = self.engine.stats.spec_decoding  # copied: the engine's thread goes on counting
        if spec is not None:
            spec = dataclasses.replace(
                spec, num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos)
            )
        self.snapshot = EngineSnapshot(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_blocks_in_use=self.engine.storage.num_blocks_in_use,
            num_blocks=self.engine.config.num_blocks,
            num_preemptions=old.num_preemptions + (record.num_preemptions if record else 0),
            prefix_cache_queries=old.prefix_cache_queries
            + (record.prefix_query_tokens if record else 0),
            prefix_cache_hits=old.prefix_cache_hits + (record.prefix_hit_tokens if record else 0),
            spec_decoding=spec,
        )

    def _fail_everything(self, error: EngineDeadError) -> None:
        """The loop is dead: tell every request in flight and every queued command."""
        for sink in set(self.sinks.values()):
            _deliver(sink, error)
        self.sinks.clear()
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                _deliver(command[4], error)
            elif command[0] == "call":
                command[2].set_exception(error)
        with self._lock:
            self.num_in_flight = 0

    def _drain(self, block: bool) -> None:
        try:
            command = self.inbox.get(timeout=self.IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(command)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _execute(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_ids, prompt, params, sink = command
            added = []
            try:
                if len(request_ids) > 1 and len(prompt) > 1:
                    self.engine.add_parallel_requests(request_ids, prompt, params)
                else:  # one choice, or a one-token prompt: no prompt to share, nothing to fork
                    for request_id, request_params in zip(request_ids, params):
                        self.engine.add_request(request_id, prompt, request_params)
                        added.append(request_id)
            except Exception as error:  # refused (bad prompt, too long, ...): tell its client
                for request_id in added:
                    self.engine.abort_request(request_id)
                    self.engine.requests.pop(request_id, None)
                with self._lock:
                    self.num_in_flight -= len(request_ids)
                _deliver(sink, error)
                return
            for request_id in request_ids:
                self.sinks[request_id] = sink
        elif kind == "abort":
            for request_id in command[1]:
                if request_id in self.sinks:
                    self.engine.abort_request(request_id)
                    self._finish(request_id, aborted=True)
        elif kind == "call":
            _, function, future = command
            try:
                future.set_result(function(self.engine))
            except Exception as error:
                future.set_exception(error)

    def _finish(self, request_id: str, *, aborted: bool, notify: Exception | None = None) -> None:
        sink = self.sinks.pop(request_id, None)
        self._scheduled.discard(request_id)
        if sink is None:
            return
        if notify is not None:
            self.engine.abort_request(request_id)
            _deliver(sink, notify)
        self.engine.requests.pop(request_id, None)  # a long-running server forgets it
        with self._lock:
            self.num_in_flight -= 1
        if aborted:
            self.num_aborted += 1
        else:
            self.num_finished += 1


def _last_step(engine: LLMEngine):
    """The `StepStats` record of the engine's latest step (its public statistics)."""
    return engine.stats[-1]


def _deliver(sink: Callable, item) -> None:
    """Call a sink; a sink that fails (its event loop closed) must not stop the engine."""
    try:
        sink(item)
    except Exception:
        pass
