"""One choice of a completion, from token ids to what the client receives (chapter 13).

A `Choice` owns the text side of one engine request: its incremental detokenizer, its stop-string
matcher, the text sent so far, the token ids it counts and their logprobs. `accept(output)` takes
the engine's `RequestOutput` for the request and returns the text to send now; `finish_reason`
becomes "stop" (EOS or a stop string) or "length" (max_tokens). When a stop string ends a choice
before the engine finished it, `needs_abort` tells the server to abort the engine request, so
its blocks are freed now rather than after max_tokens. The server stamps the times of its first
and latest tokens (`first_token_s`, `last_token_s`: `time.perf_counter()`) for its metrics.
"""

from __future__ import annotations

from kvlib.engine import FinishReason, RequestOutput
from kvlib.serve.detokenize import IncrementalDetokenizer, StopStringMatcher
from kvlib.serve.logprobs import completion_logprobs

__all__ = ["Choice"]


class Choice:
    """Args: request_id (the engine's), index (OpenAI's choice index), model (a `ServedModel`),
    prompt_token_ids, stop (stop strings), logprobs (None, or how many top logprobs to report),
    skip_special_tokens (leave the tokenizer's special tokens out of the text: vLLM's default)."""

    def __init__(
        self,
        request_id,
        index,
        model,
        prompt_token_ids,
        stop,
        logprobs=None,
        skip_special_tokens=True,
    ):
        self.request_id, self.index, self.model = request_id, index, model

        def decode(ids):
            return model.decode(ids, skip_special_tokens=skip_special_tokens)

        self.detokenizer = IncrementalDetokenizer(decode, prompt_token_ids)
        self.prompt_token_ids = list(prompt_token_ids)
        self.matcher = StopStringMatcher(stop)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs = logprobs
        self.token_logprobs: list = []  # engine TokenLogprobs per counted token
        self.token_texts: list[str] = []  # the detokenizer's text for each token ("" if EOS)
        self.finish_reason: str | None = None
        self.needs_abort = False
        self.scheduled_s: float | None = None  # its first step's end (metrics: queue time)
        self.first_token_s: float | None = None  # stamped by the server (metrics)
        self.last_token_s: float | None = None
        self.num_observed = 0  # tokens the server's metrics have counted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, output: RequestOutput) -> str:
        """The text this output adds (possibly ""); updates `finish_reason`."""
        if self.finished:
            return ""
        delta = ""
        for position, token_id in enumerate(output.new_token_ids):
            self.token_ids.append(token_id)
            if output.logprobs is not None:
                self.token_logprobs.append(output.logprobs[position])
            if token_id in self.model.eos_token_ids:
                self.token_texts.append("")
                return self._send(delta + self._end("stop"))
            piece = self.detokenizer.push(token_id)
            self.token_texts.append(piece)
            safe, stopped = self.matcher.push(piece)
            delta += safe
            if stopped:
                self.finish_reason = "stop"
                self.needs_abort = not output.finished
                return self._send(delta)
        if output.finished:
            reason = "stop" if output.finish_reason is FinishReason.STOP else "length"
            delta += self._end(reason)
        return self._send(delta)

    def _send(self, delta: str) -> str:
        self.text += delta
        return delta

    def _end(self, reason: str) -> str:
        """Flush the detokenizer through the matcher (a stop string may still complete)."""
        safe, stopped = self.matcher.push(self.detokenizer.flush())
        if not stopped:
            safe += self.matcher.flush()
        self.finish_reason = "stop" if stopped else reason
        return safe

    def completion_logprobs(self, start: int = 0) -> dict | None:
        """OpenAI's completions `logprobs` object for the counted tokens from `start` on
        (`kvlib.serve.logprobs`), or None when the request did not ask for logprobs."""
        if self.logprobs is None:
            return None
        texts = self.token_texts[: len(self.token_logprobs)]
        return completion_logprobs(
            self.model.tokenizer, self.logprobs, self.token_logprobs, texts, start
        )
