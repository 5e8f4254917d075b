"""Requests and their sampling parameters (chapter 12), named as vLLM v1 names them.

A `Request` is one prompt being served: its token ids (prompt, then the tokens generated so far),
how many of them have K/V in the cache (`num_computed_tokens`), its status, its sampling
parameters and its own random generator, and the steps and times that make up its latency
metrics. The scheduler moves it between the waiting and running queues; a preempted request goes
back to waiting with `num_computed_tokens = 0` and keeps its generated tokens, so recomputing it is
a prefill of prompt + output (preemption by recomputation, vLLM's default).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch

from kvlib._validate import same_device

__all__ = [
    "FinishReason",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "TokenLogprobs",
]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request picks its next token, and when it stops (vLLM's `SamplingParams`).

    Args:
        temperature: below `GREEDY_TEMPERATURE` (1e-5; 0 included) for greedy (argmax); above
            it samples from softmax(logits / temperature).
        top_k: sample among the k most likely tokens only (None: all).
        top_p: nucleus sampling: the smallest set of most likely tokens whose probability sums to
            at least top_p (Holtzman et al., 2020, "The Curious Case of Neural Text
            Degeneration"); None or 1.0: all.
        seed: seeds the request's own generator, so its samples do not depend on which other
            requests share its batches (None: seed 0).
        max_tokens: tokens to generate, at most (>= 1).
        stop_token_ids: generating one of these ends the request (it is kept in the output). Left
            empty, every request generates exactly `max_tokens` tokens: the fixed output lengths
            a benchmark needs.
        logprobs: also return, for each generated token, its log-probability and the `logprobs`
            most likely tokens' (under the model's distribution, before temperature, top-k and
            top-p, as OpenAI's and vLLM's `logprobs` are); None: none (chapter 13's server).

    Raises:
        ValueError, TypeError: a value outside the ranges above, naming the argument.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0:
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        for name, low in (("top_k", 1), ("max_tokens", 1), ("seed", 0), ("logprobs", 0)):
            value = getattr(self, name)
            if value is None and name != "max_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        if self.top_p is not None and not (
            isinstance(self.top_p, int | float) and 0 < self.top_p <= 1
        ):
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        stops = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids: expected ints >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its K/V freed)
    RUNNING = "running"  # holds blocks; scheduled every step until it finishes
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # generated max_tokens
    STOP = "stop"  # generated a stop token
    ABORT = "abort"  # aborted by its client (`LLMEngine.abort_request`)


@dataclasses.dataclass
class Request:
    """One request and its progress. Steps count engine steps (`LLMEngine.step` calls); times are
    seconds on the engine's clock (the sum of the wall times of the steps so far)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_step: int = 0
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    # tokens a step still in flight is sampling (the overlapped engine): counted in `num_tokens`,
    # their ids not on the host yet (`token_ids` gives None for them)
    num_output_placeholders: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (prefix hits included)
    num_cached_tokens: int = 0  # of those, tokens first found in the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_token_step: int | None = None
    first_token_time: float | None = None
    finish_step: int | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = dataclasses.field(default=None, init=False, repr=False)

    def generator_for(self, device: torch.device | str) -> torch.Generator:
        """The request's sampling generator, seeded with `sampling_params.seed`, on `device` (the
        logits' device: `torch.multinomial` refuses a generator on another device). Created on
        first use, then kept, so the request's random stream continues across steps."""
        device = torch.device(device)
        if self.generator is None or not same_device(self.generator.device, device):
            self.generator = torch.Generator(device=device).manual_seed(
                self.sampling_params.seed or 0
            )
        return self.generator

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and generated token ids (placeholders excluded)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt, generated and placeholder tokens: what the scheduler plans over."""
        return (
            len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders
        )

    def token_id(self, index: int) -> int | None:
        """Token `index` of prompt + output; None for a placeholder past the generated ones."""
        k = index - len(self.prompt_token_ids)
        if k < 0:
            return self.prompt_token_ids[index]
        return self.output_token_ids[k] if k < len(self.output_token_ids) else None

    def token_ids(self, start: int, end: int) -> list[int | None]:
        """Token ids `start .. end - 1` of prompt + output, None for placeholders past the
        generated ones (without concatenating the whole sequence)."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        prompt_len = len(prompt)
        if end <= prompt_len:
            return prompt[start:end]
        if start >= prompt_len:
            ids = output[start - prompt_len : end - prompt_len]
        else:
            ids = prompt[start:] + output[: end - prompt_len]
        missing = end - start - len(ids)
        return ids + [None] * missing if missing else ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        """Add a generated token; finish the request if it is a stop token or the last one."""
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        if token_id in params.stop_token_ids:
            self.status, self.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
        elif len(self.output_token_ids) >= params.max_tokens:
            self.status, self.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH


@dataclasses.dataclass
class RequestOutput:
    """What `LLMEngine.step` streams for a request that produced tokens (and what `generate`
    returns once it has finished): `new_token_ids` are this step's, `output_token_ids` all so
    far; `logprobs`, when the request asked for them, one `TokenLogprobs` per new token. A
    snapshot: the engine never changes one it has returned (not frozen only because a frozen
    dataclass takes eight times as long to build, for every request at every step)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    new_token_ids: Sequence[int]
    finished: bool
    finish_reason: FinishReason | None
    logprobs: Sequence[TokenLogprobs] | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely tokens' (id, log-probability), most
    likely first, under the model's distribution (before temperature, top-k and top-p)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
