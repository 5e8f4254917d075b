"""Hugging Face Llama-format checkpoints: `config.json` and `*.safetensors`, read and written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvlib.errors import UnsupportedConfigError
from kvlib.model import LlamaModel, ModelConfig


def save_hf_checkpoint(model: LlamaModel, path: str | os.PathLike) -> None:
    """Write `config.json` and `model.safetensors` in the Hugging Face Llama layout."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_hf_checkpoint(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LlamaModel:
    """Load a local Hugging Face Llama-format checkpoint (config.json + *.safetensors) by parameter
    name.

    Args:
        path: the checkpoint directory.
        dtype: load the weights in this dtype (default: the config's `torch_dtype`/`dtype`).
    Raises:
        FileNotFoundError: no config.json or no safetensors files.
        UnsupportedConfigError: see `ModelConfig.from_hf`.
        ValueError: missing or unexpected parameters, or shapes that disagree with the config.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"path: no config.json in {path}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"path: no *.safetensors files in {path}")
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    if dtype is None:  # the config's dtype name (normalised by kvlib.config) as a torch dtype
        dtype = getattr(torch, config.torch_dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise UnsupportedConfigError(
                f"config: weights in {config.torch_dtype!r} are not supported; pass dtype="
            )
    state = {}
    for file in files:
        state.update(load_file(str(file), device=str(device)))
    return model_from_state_dict(config, state, dtype=dtype, device=device, source=str(path))


def model_from_state_dict(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    source: str = "state dict",
) -> LlamaModel:
    """A `LlamaModel` holding `state` (Hugging Face parameter names), in `dtype`, in eval mode.

    Raises:
        ValueError: missing or unexpected parameters, or shapes that disagree with the config (the
            message names `source`).
    """
    path = source
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state.pop("lm_head.weight", None)
    state = {
        k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")
    }  # buffers some exports include
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path}: missing parameters {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"checkpoint {path}: {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()
