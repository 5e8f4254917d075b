"""One choice of a completion, from token ids to what the client receives (chapter 13).

A `Choice` owns the text side of one engine request: its incremental detokenizer, its stop-string
matcher, the text sent so far, the token ids it counts and their logprobs. `accept(output)` takes
the engine's `RequestOutput` for the request and returns the text to send now; `finish_reason`
becomes "stop" (EOS or a stop string) or "length" (max_tokens). When a stop string ends a choice
before the engine finished it, `needs_abort` tells the server to abort the engine request, so
its blocks are freed now rather than after max_tokens.
"""

from __future__ import annotations

from kvlib.engine import FinishReason, RequestOutput
from kvlib.serve.detokenize import IncrementalDetokenizer, StopStringMatcher

__all__ = ["Choice"]


class Choice:
    """Args: request_id (the engine's), index (OpenAI's choice index), model (a `ServedModel`),
    prompt_token_ids, stop (stop strings), logprobs (None, or how many top logprobs to report)."""

    def __init__(self, request_id, index, model, prompt_token_ids, stop, logprobs=None):
        self.request_id, self.index, self.model = request_id, index, model
        self.detokenizer = IncrementalDetokenizer(model.decode, prompt_token_ids)
        self.prompt_tail = [int(i) for i in prompt_token_ids][-1:]  # context for top logprobs
        self.matcher = StopStringMatcher(stop)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs = logprobs
        self.token_logprobs: list = []  # engine TokenLogprobs per counted token
        self.token_texts: list[str] = []  # the detokenizer's text for each token ("" if EOS)
        self.finish_reason: str | None = None
        self.needs_abort = False

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
        """OpenAI's completions `logprobs` object for the counted tokens from `start` on: each
        token's text is what the detokenizer released for it ("" while a character was
        unfinished), offsets count characters of the completion's text before stop strings.
        A top logprob's key is the text its token adds after the previous token (the course
        tokenizer's leading space included), so the chosen token's entry is keyed by its text
        in `tokens`, as a client looking it up expects."""
        if self.logprobs is None:
            return None
        decode = self.model.tokenizer.decode
        texts = self.token_texts[: len(self.token_logprobs)]
        offset = sum(len(t) for t in texts[:start])
        context = self.prompt_tail + self.token_ids  # context[k]: the token before token k
        tokens, token_logprobs, top, offsets = [], [], [], []
        for k, (text, entry) in enumerate(zip(texts, self.token_logprobs)):
            if k < start:
                continue
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            if self.logprobs:
                previous = context[k : k + 1]
                before = decode(previous)
                keyed = {decode(previous + [i])[len(before) :]: lp for i, lp in entry.top}
                if self.token_ids[k] in dict(entry.top):  # the chosen token: its text in tokens
                    keyed[text] = dict(entry.top)[self.token_ids[k]]
                top.append(keyed)
            else:
                top.append(None)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }
