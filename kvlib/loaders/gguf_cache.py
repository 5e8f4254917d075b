"""A GGUF checkpoint converted once into formats that load in a fraction of a second.

Why: reading a GGUF with `gguf.GGUFReader` parses every metadata field in Python, and SmolLM2's
tokenizer (49,152 tokens and 48,900 merges) makes that most of a ~6 s load, paid by every
process that loads the model. The first load converts; later loads read the conversion:

- `model.safetensors`: every parameter, dequantized (float32), in the safetensors format (a JSON
  header, then the raw tensors), **memory-mapped**: the parameters are views of the file's pages;
- `tokenizer.json`: the tokenizer in the `tokenizers` library's own format
  (`Tokenizer.from_str`), no rebuilding from a vocabulary and merges;
- `manifest.json`: the model config, the chat template, BOS/EOS ids, and the SHA-256 of the two
  files above.

The GGUF stays the source of truth: the conversion's directory is named by the key the caller
gives (for SmolLM2, the SHA-256 the wheel's RECORD lists for its GGUF file) and the converter's
`FORMAT` version, so another file or another converter converts again. A conversion is written
to a temporary directory and renamed into place, so a reader never sees a partial one; each
load checks both files' SHA-256 against the manifest, and a directory that fails (truncated,
edited, missing files) is removed and converted again, never used.

Where: `$KVLIB_CACHE_DIR` if set, else `$XDG_CACHE_HOME/kvlib`, else `~/.cache/kvlib`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from kvlib.loaders.gguf import GGUFTokenizer, load_gguf_checkpoint, load_gguf_tokenizer, open_gguf
from kvlib.loaders.hf import model_from_state_dict
from kvlib.model import LlamaModel, ModelConfig

__all__ = ["FORMAT", "cache_root", "converted_dir", "load_converted_gguf"]

FORMAT = 1  # bump when the conversion's layout or contents change
ENV = "KVLIB_CACHE_DIR"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def cache_root() -> Path:
    """kvlib's cache directory: `$KVLIB_CACHE_DIR`, else `$XDG_CACHE_HOME/kvlib`, else
    `~/.cache/kvlib` (not created here)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvlib"


def converted_dir(name: str, key: str) -> Path:
    """The directory of the conversion of GGUF `name` whose source hash is `key`.

    Raises:
        ValueError: `key` is not 8+ hexadecimal digits or `name` is not a plain file name.
    """
    if not isinstance(key, str) or len(key) < 8 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"key: expected 8+ lowercase hexadecimal digits, got {key!r}")
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise ValueError(f"name: expected a plain file name, got {name!r}")
    return cache_root() / "gguf" / f"{name}-{key[:32]}-v{FORMAT}"


def load_converted_gguf(
    path: str | os.PathLike,
    key: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[LlamaModel, GGUFTokenizer]:
    """`(model, tokenizer)` of the llama GGUF file `path`, as `load_gguf_checkpoint` and
    `load_gguf_tokenizer` give them (weights bitwise equal before the cast to `dtype`), from its
    conversion (`converted_dir(path's name, key)`), which is made first if absent or invalid.

    Args:
        path: the .gguf file (read only when converting).
        key: a hash of the GGUF's contents (hex), naming its conversion.
        dtype, device: as `load_gguf_checkpoint`'s.

    Raises:
        FileNotFoundError: no conversion and no such GGUF file. ValueError: a bad `key`. And
        what `load_gguf_checkpoint` and `load_gguf_tokenizer` raise while converting.
    """
    target = converted_dir(Path(path).name, key)
    loaded = _load(target, dtype, device)
    if loaded is None:
        if target.exists():  # invalid: never used, converted again
            shutil.rmtree(target, ignore_errors=True)
        _convert(Path(path), target)
        loaded = _load(target, dtype, device)
        if loaded is None:
            raise RuntimeError(f"path: the conversion just written to {target} does not verify")
    return loaded


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _convert(path: Path, target: Path) -> None:
    """Read the GGUF once, write its conversion beside `target`, rename it into place."""
    reader = open_gguf(path)
    model = load_gguf_checkpoint(reader, dtype=torch.float32)
    tokenizer = load_gguf_tokenizer(reader)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        from safetensors.torch import save_file

        state = {name: p.detach().contiguous() for name, p in model.named_parameters()}
        save_file(state, scratch / "model.safetensors")
        (scratch / "tokenizer.json").write_text(tokenizer.backend.to_str(), encoding="utf-8")
        manifest = dict(
            format=FORMAT,
            source=path.name,
            config=dataclasses.asdict(model.config),
            chat_template=tokenizer.chat_template,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            sha256={
                name: _sha256(scratch / name) for name in ("model.safetensors", "tokenizer.json")
            },
        )
        (scratch / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        try:
            os.rename(scratch, target)  # atomic; fails if another process renamed first
        except OSError:
            if _load_manifest(target) is None:
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _load_manifest(target: Path) -> dict | None:
    """The manifest if both files match its hashes, else None."""
    try:
        manifest = json.loads((target / "manifest.json").read_text(encoding="utf-8"))
        hashes = manifest["sha256"]
        if manifest.get("format") != FORMAT:
            return None
        for name in ("model.safetensors", "tokenizer.json"):
            if _sha256(target / name) != hashes[name]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest


def _mapped_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of one memory map (copy-on-write: writing a
    parameter never touches the file). The format: an 8-byte little-endian header length, a
    JSON header {name: {dtype, shape, data_offsets}}, then the data."""
    size = path.stat().st_size
    raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    header_len = int.from_bytes(raw[:8].numpy().tobytes(), "little")
    header = json.loads(raw[8 : 8 + header_len].numpy().tobytes())
    start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        flat = raw[start + begin : start + end].view(_DTYPES[entry["dtype"]])
        tensors[name] = flat.view(entry["shape"])
    return tensors


def _load(target: Path, dtype, device) -> tuple[LlamaModel, GGUFTokenizer] | None:
    """The conversion in `target`, or None if it is absent or does not verify."""
    manifest = _load_manifest(target)
    if manifest is None:
        return None
    from tokenizers import Tokenizer

    config = ModelConfig(**manifest["config"])
    state = _mapped_tensors(target / "model.safetensors")
    model = model_from_state_dict(config, state, dtype=dtype, device=device, source=str(target))
    backend = Tokenizer.from_str((target / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer = GGUFTokenizer(
        backend=backend,
        chat_template=manifest["chat_template"],
        bos_token_id=manifest["bos_token_id"],
        eos_token_id=manifest["eos_token_id"],
    )
    return model, tokenizer
