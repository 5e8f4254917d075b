"""Overlapping the host with the device (issue 48, part 1): where a step's device work runs, and
how its tokens come back.

A synchronous engine's step is: schedule, prepare the inputs, launch the forward and the sampling,
**wait** for the tokens, update the requests. On a GPU the device idles while the host schedules
and prepares, and the host idles while the device computes. SGLang's overlap scheduler
(`event_loop_overlap` in `managers/scheduler.py`) and vLLM v1's async scheduling remove both
waits: while step n runs on the device, the host schedules and prepares step n + 1, launches it
behind step n, and only then waits for step n's tokens. Step n + 1 must feed tokens step n has
not returned yet: the scheduler counts them as **placeholders** (`Request.num_output_placeholders`)
and the runner takes their ids from step n's sampled ids on the device
(`kvlib.engine.input_batch`). The stop conditions are checked one step late, so a request that
finishes at step n has already been launched in step n + 1: that extra token is dropped
(`Scheduler.record_sampled`). Tokens are the synchronous engine's, token for token.

The device work of a step is one job, run in order by a **device queue**:

- `InlineDevice` runs the job at once on the calling thread. On a CUDA device that only *queues*
  kernels (the stream runs them in order, later), and for the overlapped engine the job's
  tokens travel to pinned host memory with a non-blocking copy and an event
  (`start_transfer`): `StepHandle.result` waits on the event only.
  On a CPU the job computes before returning, so nothing overlaps, but the engine's data flow is
  the same.
- `WorkerThreadDevice` runs the jobs on one worker thread, in submission order, as a CUDA stream
  runs kernels: a CPU stand-in for an asynchronous device. With `delay_s` every job first sleeps,
  so its results arrive late: the tests use it to check that the host never reads what a step
  has not produced yet.

What stays on the host: the block manager and every request's state. What a job may touch: the
KV pools (copy-on-write block copies first, then the forward's writes), the step's staged inputs,
the requests' sampling generators, and the runner's previous sampled ids.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import torch

from kvlib.engine.request import TokenLogprobs
from kvlib.engine.sampler import StepSample, to_host

__all__ = ["InlineDevice", "StepHandle", "WorkerThreadDevice"]


class _Done:
    """A job's result, already there (`InlineDevice`)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class InlineDevice:
    """Runs each job as it is submitted, on the calling thread (see the module docstring)."""

    def submit(self, job: Callable[[], object]) -> _Done:
        return _Done(job())


class WorkerThreadDevice:
    """Runs jobs on one worker thread in submission order; each first sleeps `delay_s` seconds
    (a device whose results arrive late). `close()` stops the thread."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvlib-device")

    def submit(self, job: Callable[[], object]) -> concurrent.futures.Future:
        def delayed():
            time.sleep(self.delay_s)
            with torch.no_grad():  # grad mode is per thread
                return job()

        return self._executor.submit(delayed)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class StepHandle:
    """A launched step's sampled tokens, on their way to the host: `result()` waits for them and
    returns ({request id: token}, {request id: TokenLogprobs} for those that asked). `job_result`
    is what the device queue returned for the step's job (None: nothing was launched)."""

    def __init__(self, job_result, request_ids: list[str]):
        self._job_result, self.request_ids = job_result, request_ids

    def result(self) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        done = None if self._job_result is None else self._job_result.result()  # a job's error
        if done is None:  # nothing launched, or a step of prefill chunks only: nothing sampled
            return {}, {}
        sample, event = done
        if event is not None:
            event.synchronize()  # the copy to pinned memory has landed; the device runs on
        ids, logprobs = to_host(sample)
        sampled = dict(zip(self.request_ids, ids))
        return sampled, {self.request_ids[row]: entry for row, entry in logprobs.items()}


def start_transfer(sample: StepSample) -> tuple[StepSample, torch.cuda.Event | None]:
    """Begin the step's one device-to-host copy without waiting: on CUDA into pinned host memory,
    with an event recorded behind it; elsewhere nothing to do."""
    if sample.packed.device.type != "cuda":
        return sample, None
    host = torch.empty(sample.packed.shape, dtype=sample.packed.dtype, pin_memory=True)
    host.copy_(sample.packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return dataclasses.replace(sample, packed=host), event
