"""Importing Triton only when a kernel is launched: the course's kernels live in modules of
`@triton.jit` functions (`kvlib.ops.triton_decode`, `kvlib.ops.triton_prefill`) that import
Triton at their top, and the functions that launch them (`kvlib.kernels.paged_decode_attention`,
`kvlib.ops.varlen_attention.varlen_paged_attention`) import those modules through
`import_triton_module` on first use. So where Triton does not install (macOS, native Windows),
kvlib still imports, its references (`*_ref`) run, and a launch raises `TritonUnavailableError`
saying what to use instead."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["TritonUnavailableError", "import_triton_module", "triton_available"]


class TritonUnavailableError(ImportError):
    """A Triton kernel was launched where Triton cannot be imported (macOS, native Windows, or
    not installed)."""


def triton_available() -> bool:
    """Whether Triton can be imported here (it installs on Linux, and on Windows inside WSL2)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def import_triton_module(name: str, function: str, where: str) -> ModuleType:
    """Import the kvlib module `name` of `@triton.jit` kernels, for its first launch by
    `where`.`function` (the public function the learner called, named in the error).

    Args:
        name: the module's dotted name, e.g. "kvlib.ops.triton_decode".
        function: the launching function's name, e.g. "paged_decode_attention"; its plain-torch
            twin `function + "_ref"` is what the error suggests.
        where: the module that defines `function`, e.g. "kvlib.kernels".

    Raises:
        TritonUnavailableError: Triton is not importable here (the message says what to do).
        ImportError: the module itself failed to import for another reason (a broken kvlib),
            re-raised unchanged.
    """
    try:
        return importlib.import_module(name)
    except ImportError as error:
        if error.name is None or error.name.split(".")[0] != "triton":
            raise  # a broken kvlib, not a missing Triton
        raise TritonUnavailableError(
            f"{function} launches a Triton kernel, and Triton cannot be imported here "
            f"({error}). Triton runs on Linux (on Windows, inside WSL2): `pip install triton` "
            "(without a CUDA GPU, kvlib runs it under Triton's CPU interpreter). Without "
            f"Triton, use {where}.{function}_ref: the same arguments and result, in plain torch."
        ) from error
