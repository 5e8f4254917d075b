"""The wire between the grader and the learner's process: length-prefixed frames over two pipes
(`Channel`), and values sent by value (`encode`/`decode`).

The grader sends pickled requests (inputs are data it made itself); the learner's side answers with
*encoded* values: tensors, arrays, numbers, strings and containers as nested tuples of plain data,
rebuilt by the grader without running any code from the learner's side (its unpickler refuses
every global). An object of another type comes back as an `Opaque` (type name, repr, attributes).
It does not decide what is sent or judge it: `kvlib.course.sandbox` serves requests, and
`kvlib.course.grading` holds the tests.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import select
import struct
import sys

MAX_FRAME_BYTES = 512 * 2**20  # a reply larger than this is refused


class ChannelClosed(Exception):
    """The other side ended (its process exited or closed the pipe)."""


class ChannelTimeout(Exception):
    """Nothing arrived in time."""


# --- transport ------------------------------------------------------------------------------------


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


class Channel:
    """Frames over a pair of file descriptors. `trusted`: unpickle with every global allowed (only
    where the sender is the grader); otherwise no global at all (the reply is encoded data)."""

    def __init__(self, read_fd: int, write_fd: int, *, trusted: bool):
        self.read_fd, self.write_fd, self.trusted = read_fd, write_fd, trusted

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=4)
        payload = struct.pack("<Q", len(data)) + data
        view = memoryview(payload)
        while view:
            try:
                written = os.write(self.write_fd, view)
            except (BrokenPipeError, OSError) as exc:
                raise ChannelClosed(str(exc)) from None
            view = view[written:]

    def _read(self, size: int, deadline: float | None) -> bytes:
        import time

        chunks, left = [], size
        while left:
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0 or not select.select([self.read_fd], [], [], wait)[0]:
                    raise ChannelTimeout()
            try:
                chunk = os.read(self.read_fd, min(left, 1 << 20))
            except OSError as exc:
                raise ChannelClosed(str(exc)) from None
            if not chunk:
                raise ChannelClosed("end of stream")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def recv(self, timeout_s: float | None = None):
        import time

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        (size,) = struct.unpack("<Q", self._read(8, deadline))
        if size > MAX_FRAME_BYTES:
            raise ChannelClosed(f"a reply of {size:,} bytes is larger than the grader accepts")
        data = self._read(size, deadline)
        if self.trusted:
            return pickle.loads(data)
        return _NoGlobals(io.BytesIO(data)).load()


# --- values by value ------------------------------------------------------------------------------


def encode(value, memo: dict | None = None, depth: int = 0):
    """`value` as nested tuples of plain data (see the module docstring); objects seen twice
    become references, so identity within one reply survives."""
    import numpy as np

    memo = {} if memo is None else memo
    if depth > 60:
        return ("X", "a structure nested more than 60 levels deep")
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        if type(value) in (bool, int, float, complex, str, bytes, type(None)):
            return ("P", value)
    key = id(value)
    if key in memo:
        return ("R", memo[key][0])
    memo[key] = (len(memo), value)  # keep value alive so ids stay unique
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                return ("O", type(value).__name__, "a torch.Tensor subclass", ())
            t = value.detach()
            if t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized:
                t = t.to_dense() if t.layout != torch.strided else t
                t = t.cpu()
            flat = t.contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return ("T", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return ("O", "ndarray", "a numpy array of Python objects", ())
        return ("A", value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, np.generic):
        return ("S", value.dtype.str, value.tobytes())
    if type(value) is list:
        return ("L", tuple(encode(v, memo, depth + 1) for v in value))
    if type(value) is tuple:
        return ("U", tuple(encode(v, memo, depth + 1) for v in value))
    if type(value) is dict:
        return (
            "D",
            tuple(
                (encode(k, memo, depth + 1), encode(v, memo, depth + 1)) for k, v in value.items()
            ),
        )
    if type(value) in (set, frozenset):
        kind = "E" if type(value) is set else "F"
        return (kind, tuple(encode(v, memo, depth + 1) for v in value))
    attrs = ()
    with contextlib.suppress(Exception):
        fields = getattr(value, "__dict__", None)
        if isinstance(fields, dict):
            attrs = tuple(
                (str(k), encode(v, memo, depth + 1))
                for k, v in list(fields.items())[:50]
                if isinstance(k, str)
            )
    return ("O", type(value).__name__, _safe_repr(value), attrs)


def _safe_repr(value) -> str:
    try:
        return repr(value)[:200]
    except BaseException:  # noqa: BLE001 - a learner's __repr__ may raise anything
        return f"<{type(value).__name__}>"


class Opaque:
    """A value the grader cannot rebuild (an object of the learner's own class, ...): its type name,
    repr and attributes (decoded), for messages and attribute checks."""

    def __init__(self, type_name: str, text: str):
        self._type_name, self._text = type_name, text

    def __repr__(self) -> str:
        return self._text


_OPAQUE_TYPES: dict[str, type] = {}


def decode(node, refs: list | None = None):
    """The value `encode` described, rebuilt from plain data."""
    import numpy as np
    import torch

    refs = [] if refs is None else refs
    if not isinstance(node, tuple) or not node or not isinstance(node[0], str):
        raise ValueError("malformed reply")
    kind = node[0]
    if kind == "P":
        return node[1]
    if kind == "R":
        return refs[node[1]]
    slot = len(refs)
    refs.append(None)
    if kind == "T":
        _, dtype, shape, raw = node
        torch_dtype = getattr(torch, dtype)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
        if flat is None:
            value = torch.empty(shape, dtype=torch_dtype)
        else:
            value = flat.view(torch_dtype).reshape(shape).clone()
    elif kind == "A":
        _, dtype, shape, raw = node
        value = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    elif kind == "S":
        value = np.frombuffer(node[2], dtype=np.dtype(node[1]))[0]
    elif kind == "L":
        value = []
        refs[slot] = value
        value.extend(decode(v, refs) for v in node[1])
    elif kind == "U":
        value = tuple(decode(v, refs) for v in node[1])
    elif kind == "D":
        value = {}
        refs[slot] = value
        for k, v in node[1]:
            value[decode(k, refs)] = decode(v, refs)
    elif kind in ("E", "F"):
        items = [decode(v, refs) for v in node[1]]
        value = set(items) if kind == "E" else frozenset(items)
    elif kind == "O":
        _, type_name, text, attrs = node
        cls = _OPAQUE_TYPES.setdefault(type_name, type(str(type_name), (Opaque,), {}))
        value = cls(type_name, text)
        refs[slot] = value
        for name, v in attrs:
            with contextlib.suppress(Exception):
                setattr(value, name, decode(v, refs))
    elif kind == "X":
        raise ValueError(node[1])
    else:
        raise ValueError(f"malformed reply node {kind!r}")
    refs[slot] = value
    return value
