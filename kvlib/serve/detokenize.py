"""Token ids back to text, one token at a time (chapter 13): what a streaming server sends.

Two problems, both invisible on ASCII text:

- **Byte-level BPE splits characters.** A token is a run of *bytes*; a character that UTF-8
  encodes in 2-4 bytes may end in the next token. Decoding each token alone shows U+FFFD (the
  replacement character) for the halves. `IncrementalDetokenizer` decodes a short window of
  recent tokens and emits only the new text, holding it back while it ends in an unfinished
  character (the prefix/read-offset scheme of Hugging Face's text-generation-inference and vLLM's
  `detokenize_incrementally`). Decoding a window, not the token alone, also keeps what a tokenizer
  does across tokens (SentencePiece's leading-space rule).
- **Stop strings span tokens.** `stop=["\\n\\n"]` may arrive as "\\n" then "\\n", or inside a
  token with text after it. `StopStringMatcher` holds back the longest tail of the text that could
  still begin a stop string, releases it when it cannot, and on a match returns the text before
  the stop string only: the stop string and anything after it are never sent (OpenAI's rule).

Both are pure text bookkeeping over a `decode(ids) -> str` function; neither knows the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "REPLACEMENT_CHARACTER"]

REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder shows for bytes that are not (yet) a character


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    `push(token_id) -> str` returns the text the new token completes ("" while a character is
    still unfinished); `flush() -> str` returns what is left at the end (an unfinished character
    then shows as U+FFFD, as the whole decode would show it). The deltas concatenate to
    `decode(all ids)` whenever decoding a window equals the tail of decoding everything (true of
    byte-level BPE, whose decode is the bytes' concatenation).

    Args:
        decode: token ids -> text (the tokenizer's, special tokens already excluded by the caller).
        prompt_token_ids: ids before the first generated token; the last few seed the window so
            that the first generated token decodes in context (nothing of the prompt is emitted).
    """

    CONTEXT_TOKENS = 5  # prompt tokens decoded for context (vLLM's initial offset is 5 too)

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_token_ids=()):
        self.decode = decode
        self.token_ids: list[int] = list(prompt_token_ids)[-self.CONTEXT_TOKENS :]
        self.prefix_offset = 0  # window start: decoded for context only
        self.read_offset = len(self.token_ids)  # tokens before this have been emitted

    def push(self, token_id: int) -> str:
        self.token_ids.append(int(token_id))
        prefix_text = self.decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self.decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHARACTER):
            return ""  # an unfinished character: wait for its next bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text of tokens pushed but not emitted (an unfinished character at the end)."""
        prefix_text = self.decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self.decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]


class StopStringMatcher:
    """Finds stop strings in streamed text without leaking any part of them.

    `push(text) -> (safe_text, stopped)`: `safe_text` may be sent now; once `stopped` is True,
    `safe_text` ends just before the earliest stop string and the request is over. Text that
    could still be the start of a stop string is held back (at most the longest stop string's
    length - 1 characters); `flush()` returns it at the end of a request that did not stop.

    Args:
        stop: the stop strings (empty strings are refused).

    Raises:
        ValueError: an empty stop string; TypeError: a stop that is not a str.
    """

    def __init__(self, stop: Sequence[str] = ()):
        stop = list(stop)
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop: expected strings, got {s!r}")
            if not s:
                raise ValueError("stop: expected non-empty strings, got ''")
        self.stop = stop
        self.held = ""  # text received, not yet released
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.held += text
        starts = [i for i in (self.held.find(s) for s in self.stop) if i >= 0]
        if starts:  # the earliest stop string wins; it and everything after it are dropped
            safe, self.held, self.stopped = self.held[: min(starts)], "", True
            return safe, True
        keep = self._partial_match_length(self.held)
        safe, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return safe, False

    def _partial_match_length(self, text: str) -> int:
        """The longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The held-back text, at the end of a request that did not stop."""
        text, self.held = ("" if self.stopped else self.held), ""
        return text
