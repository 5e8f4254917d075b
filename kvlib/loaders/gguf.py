"""Llama-architecture GGUF checkpoints (llama.cpp's file format): the model and its tokenizer.

What it does: reads a GGUF file with the `gguf` package (ggml-org's reader), builds the
`ModelConfig` from its `llama.*` metadata, dequantizes every tensor with `gguf.quants` (Q4_1,
Q8_0, F16, F32, ... whatever that package can dequantize), renames tensors to Hugging Face's
parameter names, and undoes the row permutation llama.cpp's converter applies to the Q and K
projections. The tokenizer is rebuilt from the metadata's vocabulary and merges with the
`tokenizers` library (byte-level BPE), and the chat template is rendered with jinja2.

Why the permutation: Hugging Face's Llama rotates the two *halves* of each head's dimensions
(`rotate_half`); llama.cpp rotates *interleaved pairs* (dimensions 2i and 2i+1). llama.cpp's
`convert_hf_to_gguf.py` reorders the rows of W_q and W_k so that its rotation computes the same
thing; loading those rows into a `rotate_half` model without reordering them back gives a model
that runs and produces fluent-looking garbage.

What it deliberately does not do: other architectures, or running quantized: the weights are
dequantized once, so the model studied is the dequantized model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvlib.errors import UnsupportedConfigError
from kvlib.loaders.hf import model_from_state_dict
from kvlib.model import LlamaModel, ModelConfig

__all__ = [
    "GGUFTokenizer",
    "gguf_config",
    "load_gguf_checkpoint",
    "load_gguf_tokenizer",
    "longest_token_bytes",
    "open_gguf",
    "undo_qk_permutation",
]

# GGUF tensor names -> Hugging Face Llama parameter names ("{i}" is the layer index)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def open_gguf(path):
    """A `gguf.GGUFReader` for `path` (or `path` itself if it is one: read a file once)."""
    import gguf

    if isinstance(path, gguf.GGUFReader):
        return path
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no such GGUF file {path}")
    return gguf.GGUFReader(str(path))


def _metadata(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise UnsupportedConfigError(f"GGUF: missing metadata field {key!r}")
    return field.contents()


def gguf_config(reader) -> ModelConfig:
    """The `ModelConfig` of a llama-architecture GGUF (a `gguf.GGUFReader`).

    Raises:
        UnsupportedConfigError: another architecture, or a missing field (named).
    """
    arch = _metadata(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedConfigError(
            f"GGUF: general.architecture {arch!r} is not supported; kvlib loads 'llama'"
        )
    heads = int(_metadata(reader, "llama.attention.head_count"))
    hidden = int(_metadata(reader, "llama.embedding_length"))
    head_dim = int(_metadata(reader, "llama.rope.dimension_count", hidden // heads))
    if _metadata(reader, "llama.rope.scaling.type", "none") not in ("none", ""):
        raise UnsupportedConfigError("GGUF: rope scaling is not supported")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    vocab = int(
        _metadata(reader, "llama.vocab_size", len(_metadata(reader, "tokenizer.ggml.tokens")))
    )
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_metadata(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_metadata(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_metadata(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(_metadata(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_metadata(reader, "llama.context_length")),
        tie_word_embeddings=tied,
        torch_dtype="float32",
    )


def undo_qk_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of a GGUF W_q or W_k `(num_heads · D, d_model)` back in Hugging Face's order.

    llama.cpp's converter stores, within each head, the rows of the first half-dimension and the
    second interleaved (rows i and D/2 + i become rows 2i and 2i + 1); this puts them back.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def load_gguf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    undo_permutation: bool = True,
) -> LlamaModel:
    """A `LlamaModel` from a llama-architecture GGUF file, weights dequantized to `dtype`.

    Args:
        path: the .gguf file (or a `gguf.GGUFReader` of it).
        dtype: the weights' dtype after dequantization.
        undo_permutation: False loads W_q and W_k in llama.cpp's row order (wrong for this model:
            only for demonstrating the pitfall).
    Raises:
        FileNotFoundError: no such file. UnsupportedConfigError: another architecture, a missing
        field, or a tensor type `gguf.quants` cannot dequantize (named with the tensor).
        ValueError: tensors that do not match the config.
    """
    import gguf

    reader = open_gguf(path)
    config = gguf_config(reader)
    state = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        else:
            parts = name.split(".")  # blk.{i}.{kind}.weight
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                raise ValueError(f"GGUF {path}: unexpected tensor {name!r}")
            hf_name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise UnsupportedConfigError(
                f"GGUF: tensor {name!r} has type {tensor.tensor_type.name}, which gguf.quants "
                "cannot dequantize"
            ) from None
        values = np.array(values, dtype=np.float32).reshape(  # a writable copy of the mmap
            [int(n) for n in reversed(tensor.shape)]
        )
        if undo_permutation and hf_name.endswith("q_proj.weight"):
            values = undo_qk_permutation(values, config.num_attention_heads)
        elif undo_permutation and hf_name.endswith("k_proj.weight"):
            values = undo_qk_permutation(values, config.num_key_value_heads)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    return model_from_state_dict(config, state, dtype=dtype, device=device, source=str(path))


@dataclass
class GGUFTokenizer:
    """A GGUF file's tokenizer: byte-level BPE (the `tokenizers` library) and its chat template.

    `encode(text) -> list[int]` (no BOS/EOS added), `decode(ids) -> str`,
    `apply_chat_template(messages, add_generation_prompt=True) -> list[int]`,
    `min_tokens(text) -> int` (a lower bound on `len(encode(text))`, computed without tokenizing).
    """

    backend: object  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token_id: int
    eos_token_id: int
    max_token_bytes: int = 0  # the longest token's text in UTF-8 bytes; 0: read from the vocabulary

    def __post_init__(self):
        if self.max_token_bytes == 0:
            self.max_token_bytes = longest_token_bytes(self.backend)

    def min_tokens(self, text: str) -> int:
        """At least this many tokens encode `text`: no token's text is longer than
        `max_token_bytes` UTF-8 bytes and this tokenizer normalizes nothing, so
        ceil(bytes / max_token_bytes) (SmolLM2: 81 bytes, a newline and 80 spaces). Loose (English
        prose averages about 4 bytes a token) but sound, and free next to tokenizing: the server
        refuses a prompt that cannot fit the context before spending its time on it."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template rendered with jinja2 (as transformers renders it)."""
        import jinja2

        if self.chat_template is None:
            raise ValueError("chat_template: this GGUF file has none")
        environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return environment.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def longest_token_bytes(backend) -> int:
    """The longest token's text in UTF-8 bytes, over a `tokenizers.Tokenizer`'s vocabulary, added
    tokens included: a byte-level token's characters stand for one byte each (GPT-2's byte
    alphabet), an added token (`<|im_start|>`) is its own text.

    Raises:
        ValueError: a tokenizer that normalizes its input (the bound would not hold).
    """
    if backend.normalizer is not None:
        raise ValueError("backend: a tokenizer with a normalizer; min_tokens assumes none")
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    return max(
        len(token.encode("utf-8")) if token in added else len(token)
        for token in backend.get_vocab(with_added_tokens=True)
    )


def load_gguf_tokenizer(path) -> GGUFTokenizer:
    """The tokenizer stored in a GGUF file's metadata (`tokenizer.ggml.*`, model "gpt2"); `path`
    is the .gguf file or a `gguf.GGUFReader` of it.

    Raises:
        UnsupportedConfigError: a tokenizer model other than byte-level BPE ("gpt2").
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = open_gguf(path)
    kind = _metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedConfigError(
            f"GGUF: tokenizer.ggml.model {kind!r} is not supported; kvlib reads 'gpt2' (BPE)"
        )
    tokens = list(_metadata(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _metadata(reader, "tokenizer.ggml.merges")]
    token_types = list(_metadata(reader, "tokenizer.ggml.token_type"))
    backend = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    # SmolLM's pre-tokenizer ("smollm"): every digit alone, then GPT-2's byte-level split
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp's token type CONTROL: <|im_start|>, <|endoftext|>, ...
    backend.add_special_tokens(
        [AddedToken(t, special=True) for t, kind in zip(tokens, token_types) if kind == control]
    )
    return GGUFTokenizer(
        backend=backend,
        chat_template=_metadata(reader, "tokenizer.chat_template", ""),
        bos_token_id=int(_metadata(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_metadata(reader, "tokenizer.ggml.eos_token_id")),
    )
