"""One reader of Hugging Face `config.json` files, for the model loader and the memory calculator.

- `load_config`: a path or dict -> the text model's config dict (multimodal `text_config` merged);
- `config_field`: the first of several field names a config may use (`num_hidden_layers`,
  `n_layer`, ...), validated;
- `normalize_dtype`, `config_dtype`, `DTYPE_BITS`: dtype names and their sizes;
- `attention_geometry`: `H_kv` and `D` of an attention layer, by each model type's own rules
  (Falcon's `multi_query`, an explicit `head_dim`, MHA when `num_key_value_heads` is absent);
- `shipped_configs`: the real models' configs in `kvlib/configs`.

Pure Python: the memory calculator imports it without torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvlib._validate import check_positive_int
from kvlib.errors import UnsupportedConfigError

__all__ = [
    "CONFIG_DIR",
    "DTYPE_BITS",
    "attention_geometry",
    "config_dtype",
    "config_field",
    "load_config",
    "normalize_dtype",
    "shipped_configs",
]

DTYPE_BITS = {
    "float64": 64,
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
}
_DTYPE_ALIASES = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}


def load_config(config: dict | str | os.PathLike) -> dict:
    """The text model's config as a dict: from a path or a dict; a multimodal config's `text_config`
    is merged over its top level (so a top-level `torch_dtype` still applies).

    Raises:
        FileNotFoundError: no such file. TypeError: neither a dict nor a path. ValueError: not JSON.
    """
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"config: no such file {path}")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"config: {path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise TypeError(
            f"config: expected a dict or a path to config.json, got {type(config).__name__}"
        )
    text = config.get("text_config")
    if isinstance(text, dict):
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(text)
        merged.setdefault("_outer_model_type", config.get("model_type"))
        return merged
    return dict(config)


def config_field(config: dict, *names: str) -> int:
    """The first of `names` present (and not null) in the config, as a positive int."""
    for name in names:
        if config.get(name) is not None:
            return check_positive_int(f"config[{name!r}]", config[name])
    raise UnsupportedConfigError(
        f"config: missing field {' / '.join(repr(n) for n in names)} for model_type "
        f"{config.get('model_type')!r}"
    )


def config_dtype(config: dict) -> str | None:
    """The dtype the config names (`torch_dtype` in transformers 4.x, `dtype` in 5.x), normalised,
    or None."""
    for name in ("dtype", "torch_dtype"):
        if config.get(name):
            return normalize_dtype(str(config[name]), argument=f"config[{name!r}]")
    return None


def normalize_dtype(dtype: str, *, argument: str = "cache_dtype") -> str:
    """A dtype name as one of DTYPE_BITS's keys ("bf16" -> "bfloat16", "torch.float16" ->
    "float16")."""
    name = str(dtype).lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BITS:
        raise ValueError(f"{argument}: expected one of {', '.join(DTYPE_BITS)}, got {dtype!r}")
    return name


def attention_geometry(config: dict, model_type: str) -> tuple[int, int, str]:
    """(H_kv, D, description) of a dense attention layer, as the model's own code reads them.

    Raises:
        UnsupportedConfigError: a missing field, or heads that do not divide as attention needs.
    """
    heads = config_field(config, "num_attention_heads", "n_head")
    if model_type == "falcon":  # Falcon's own flags decide the KV heads
        if config.get("new_decoder_architecture"):
            kv_heads, how = (
                config_field(config, "num_kv_heads"),
                "num_kv_heads (new_decoder_architecture)",
            )
        elif config.get("multi_query", True):
            kv_heads, how = 1, "multi_query"
        else:
            kv_heads, how = heads, "num_attention_heads (multi_query false)"
    elif config.get("num_key_value_heads") is not None:
        kv_heads, how = config_field(config, "num_key_value_heads"), "num_key_value_heads"
    else:
        kv_heads, how = heads, "num_attention_heads (no num_key_value_heads: MHA)"
    if heads % kv_heads:
        raise UnsupportedConfigError(
            f"config: num_attention_heads {heads} is not a multiple of the {kv_heads} KV heads "
            f"({how})"
        )
    if config.get("head_dim") is not None:
        head_dim, dim_how = config_field(config, "head_dim"), "head_dim"
    else:
        hidden = config_field(config, "hidden_size", "n_embd", "d_model")
        if hidden % heads:
            raise UnsupportedConfigError(
                f"config: hidden size {hidden} is not divisible by {heads} heads and there is no "
                "head_dim"
            )
        head_dim, dim_how = hidden // heads, f"hidden {hidden} / {heads} heads"
    family = "MHA" if kv_heads == heads else "MQA" if kv_heads == 1 else "GQA"
    return (
        kv_heads,
        head_dim,
        f"{family}: 2 x {kv_heads} KV heads ({how}) x D={head_dim} ({dim_how})",
    )


CONFIG_DIR = Path(__file__).with_name("configs")


def shipped_configs() -> dict[str, dict]:
    """The real models' configs that ship with kvlib (architecture fields only), by file stem."""
    return {path.stem: load_config(path) for path in sorted(CONFIG_DIR.glob("*.json"))}
