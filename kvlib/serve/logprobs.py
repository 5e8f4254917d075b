"""OpenAI's completions `logprobs` object, from the engine's per-token logprobs (chapter 13).

For each generated token the client gets four parallel lists: `tokens` (each token's name),
`token_logprobs` (its log-probability under the model's distribution, before temperature and
filters), `top_logprobs` (a dict {name: logprob} per token) and `text_offset` (where the token's
text starts in the completion, in characters). OpenAI's rules, followed here:

- `top_logprobs` holds the `logprobs` most likely tokens **and the sampled one**: "up to
  logprobs+1 elements" (a sampled token outside the top k adds one entry); with `logprobs=0` it
  holds the sampled token alone, so every token's own logprob is always in its dict.
- A token is named by its own bytes, the same way in `tokens` and in the keys of `top_logprobs`:
  its text when those bytes are valid UTF-8, otherwise `bytes:` followed by the bytes, printable
  ASCII as itself and every other byte as `\\xNN` (OpenAI's "bytes:\\xe6\\x97" for a token that
  ends inside a character). Different tokens have different bytes, so their names never collide
  as dict keys, as names decoded with U+FFFD for the partial character would.
- `text_offset` counts the characters of the completion's text released before the token (a token
  that completes no character starts where the next character will).

`token_bytes(tokenizer, token_id)` reads a token's bytes: the course tokenizer's own method, or a
byte-level BPE vocabulary (GPT-2's, SmolLM2's) through its 256-character byte alphabet.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

__all__ = ["completion_logprobs", "token_bytes", "token_name"]


def token_name(data: bytes) -> str:
    """A token's name in OpenAI's logprobs: its text if `data` is valid UTF-8, else
    `"bytes:"` + printable ASCII bytes as themselves and the others as `\\xNN`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        shown = (chr(b) if 32 <= b < 127 and b != 92 else f"\\x{b:02x}" for b in data)
        return "bytes:" + "".join(shown)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (Radford et al., 2019, GPT-2's `bytes_to_unicode`): the 188
    printable Latin-1 bytes stand for themselves, the 68 others for characters 256, 257, ... in
    byte order. {character: byte}."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {chr(b if b in printable else next(extra)): b for b in range(256)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes of one token: `tokenizer.token_bytes(id)` when it has that method (the course
    tokenizer), else a `tokenizers` byte-level BPE vocabulary (`tokenizer.backend`).

    Raises:
        TypeError: a tokenizer with neither.
    """
    if hasattr(tokenizer, "token_bytes"):
        return tokenizer.token_bytes(token_id)
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise TypeError(
            f"tokenizer: expected a token_bytes method or a byte-level BPE backend, got "
            f"{type(tokenizer).__name__}"
        )
    piece = backend.id_to_token(int(token_id))
    alphabet = _byte_alphabet()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return piece.encode()  # an added (special) token such as <|im_end|>: its text


def completion_logprobs(
    tokenizer, num_top: int, entries: Sequence, texts: Sequence[str], start: int = 0
) -> dict:
    """OpenAI's completions `logprobs` object for tokens `start` on (see the module docstring).

    Args:
        tokenizer: reads each token's bytes (`token_bytes`).
        num_top: the request's `logprobs` (0 to 20).
        entries: the engine's `TokenLogprobs` per generated token (token_id, logprob, top pairs).
        texts: the text released after each token (what the stream sent; "" inside a
            character), as long as `entries`; the offsets count its characters.
        start: the first token to report (a stream's chunk reports its new tokens).
    """
    offset = sum(len(t) for t in texts[:start])
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry, text in zip(entries[start:], texts[start:]):
        name = token_name(token_bytes(tokenizer, entry.token_id))
        tokens.append(name)
        token_logprobs.append(entry.logprob)
        ranked = {token_name(token_bytes(tokenizer, i)): lp for i, lp in entry.top[:num_top]}
        ranked[name] = entry.logprob  # the sampled token: added if outside the top k
        top.append(ranked)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
