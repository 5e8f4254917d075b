"""`kvlib.ops.interpreter.patch_scalar_index`: Triton's interpreter before 3.7 converts a kernel's
scalar to an int with `int(array)`, which NumPy >= 2.4 refuses (a DeprecationWarning before it);
the patch makes a runtime loop bound work there. Reproduced here by installing the old conversion
and turning NumPy's warning into the error NumPy 2.4 raises, in a child process (the interpreter's
patches are process-wide)."""

import subprocess
import sys

SCRIPT = """
import sys, warnings
import kvlib.kernels  # TRITON_INTERPRET=1 without CUDA, before Triton
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

fixed = interpreter._patch_lang_tensor

def _patch_lang_tensor(tensor, scope):  # Triton 3.6's conversion: int() of a 1-element array
    fixed(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

interpreter._patch_lang_tensor = _patch_lang_tensor
warnings.filterwarnings("error", message="Conversion of an array with ndim > 0")  # NumPy 2.4

@triton.jit
def total(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):  # a runtime bound: __index__ of a scalar
        offsets = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0))

x, out = torch.arange(40.0), torch.zeros(1)
if sys.argv[1] == "patched":
    from kvlib.ops.interpreter import patch_scalar_index
    triton.__version__ = "3.6.0"  # the patch applies below 3.7 only
    patch_scalar_index()
try:
    total[(1,)](x, out, 40, BLOCK=16)
    print("sum", float(out))
except Exception as error:
    print("raised", type(error).__name__, error)
"""


def run(mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_an_old_interpreter_fails_a_runtime_loop_bound_and_the_patch_fixes_it():
    unpatched = run("plain")
    assert unpatched.startswith("raised") and "Conversion of an array" in unpatched
    assert run("patched") == "sum 780.0"  # 0 + 1 + ... + 39


def test_the_grader_leaves_the_interpreter_set_up_unguarded():
    # on Triton < 3.7 the patch runs inside every interpreted launch of a learner's kernel, which
    # the grader's default-deny would otherwise stop (seen on an H200 with Triton 3.6: chapter 11's
    # two kernel questions failed with "patch_scalar_index.<locals>.patched is unavailable")
    import kvlib.ops.interpreter
    from kvlib.course import guards

    assert guards._module_name(kvlib.ops.interpreter.__file__) is None
    assert guards._module_name(guards.__file__.replace("course/guards", "ops/launch")) == (
        "kvlib.ops.launch"
    )
