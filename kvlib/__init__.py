"""kvlib: the shared package of the course *KV Cache from Scratch*.

One concept per module (see COURSE.md): `attention` (numpy reference attention and the
naive/cached generation loops of chapter 1), `memory` (cache-size arithmetic), `bench`
(timing helpers), `viz` (plots and animations), `grading` (exercise checks and the grader).

Importing `kvlib` is cheap: it imports numpy only. Modules that need torch or triton import
them themselves.
"""

from kvlib._validate import check_shape

__version__ = "0.1.0"
__all__ = ["check_shape", "__version__"]
