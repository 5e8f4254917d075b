"""Launching a compiled Triton kernel directly (issue 48, part 4).

`kernel[grid](*args, **constexprs)` costs tens of microseconds of host time on every call:
Triton binds the arguments to the kernel's signature, works out each one's specialization (its
dtype, a pointer's 16-byte alignment, an integer equal to 1 or divisible by 16), hashes that into a
cache key, finds the compiled kernel, and only then calls its launcher. A decode step calls the
attention kernel once per layer, so on a GPU that bookkeeping, not the kernel, sets the pace.

`KernelLaunch` does the bookkeeping once. Its first call goes through `kernel[grid]`, which
compiles (or finds) the kernel and returns its `CompiledKernel`; later calls hand the arguments
straight to that kernel's launcher, `CompiledKernel.run`, the last call Triton's own
`JITFunction.run` makes. That is only right while nothing the compiled kernel was specialized on
changes, so a `KernelLaunch` serves one launch plan (`kvlib.ops.decode_plan`: shapes, strides,
dtypes and devices fixed, so every integer argument but the per-call ones is fixed too) and one
split count, with fixed constexprs and launch options; and each call checks that every tensor is
still 16-byte aligned (the one property of a pointer Triton specializes on), launching through
`kernel[grid]` when one is not.

Supported: the launcher convention of Triton 3.6 and 3.7, `run(grid_x, grid_y, grid_z, stream,
function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)` with every argument of
the signature in order, constexprs included. Elsewhere (the CPU interpreter, an older or newer
Triton, a launch hook registered for profiling when the first call is made) every call goes
through `kernel[grid]`.
"""

from __future__ import annotations

import re

import torch

__all__ = ["KernelLaunch", "direct_launch_supported"]

SUPPORTED_TRITON = ((3, 6), (3, 7))  # the versions whose launcher convention this follows


def direct_launch_supported() -> bool:
    """Whether the installed Triton launches the way `KernelLaunch` drives it, with no launch hook
    (a profiler's) registered."""
    try:
        import triton
    except ImportError:
        return False
    version = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    if version not in SUPPORTED_TRITON:
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    hooks = [getattr(runtime, name, None) for name in ("launch_enter_hook", "launch_exit_hook")]
    return not any(getattr(hook, "calls", hook) for hook in hooks)


def _aligned(tensors) -> bool:
    """Every tensor's data 16-byte aligned."""
    bits = 0
    for tensor in tensors:
        bits |= tensor.data_ptr()
    return not bits & 15


class KernelLaunch:
    """One kernel at one grid, on the CUDA device `device_index` (None: not a CUDA device), with
    fixed trailing arguments `fixed` (strides, sizes), constexprs and launch options
    (`keywords`); call it with the arguments that change from call to call (pointers first, then
    scalars), which come first in the kernel's signature, the first `num_tensors` of them
    tensors."""

    __slots__ = (
        "kernel", "grid", "grid_xyz", "fixed", "keywords", "device_index", "num_tensors",
        "compiled", "tail", "stream", "tried",
    )  # fmt: skip

    def __init__(
        self, kernel, grid: tuple[int, ...], fixed: tuple, keywords: dict,
        device_index: int | None, *, num_tensors: int,
    ):  # fmt: skip
        self.kernel, self.grid, self.fixed = kernel, grid, fixed
        self.grid_xyz = (*grid, 1, 1)[:3]
        self.keywords, self.device_index, self.num_tensors = keywords, device_index, num_tensors
        self.compiled = None  # the CompiledKernel launched directly, once adopted
        self.tail = ()  # `fixed`, then the constexprs' values in signature order
        self.stream = None  # () -> the current stream's handle
        self.tried = False

    def __call__(self, *args) -> None:
        compiled = self.compiled
        if compiled is not None and _aligned(args[: self.num_tensors]):
            compiled.run(
                *self.grid_xyz,
                self.stream(),
                compiled.function,
                compiled.packed_metadata,
                None,  # launch metadata: only launch hooks read it, and none is registered
                None,
                None,
                *args,
                *self.tail,
            )
            return
        result = self.kernel[self.grid](*args, *self.fixed, **self.keywords)
        if not self.tried:
            self.tried = True
            if _aligned(args[: self.num_tensors]):
                self._adopt(result, len(args) + len(self.fixed))

    def _adopt(self, compiled, num_args: int) -> None:
        """Keep `compiled` (what `kernel[grid]` returned) for direct launches if it is a compiled
        kernel this module can drive; otherwise every call stays with `kernel[grid]`."""
        if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            return  # the interpreter returns no compiled kernel
        if not direct_launch_supported():
            return
        names = getattr(self.kernel, "arg_names", None)
        if names is None:  # a stand-in kernel (kvlib.course.bench's): the keywords' order
            names = [None] * num_args + list(self.keywords)
        constexprs = names[num_args:]
        if any(name not in self.keywords for name in constexprs):
            return  # an argument passed by keyword that is not a constexpr: keep Triton's binder
        self.tail = (*self.fixed, *(self.keywords[name] for name in constexprs))
        if self.device_index is None:  # a stand-in kernel on the CPU: no stream
            self.stream = int
        else:
            get, index = torch._C._cuda_getCurrentRawStream, self.device_index  # as Triton's driver

            self.stream = lambda: get(index)
        self.compiled = compiled
