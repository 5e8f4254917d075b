"""The wire between the grader and the learner's process: length-prefixed frames over two pipes
(`Channel`), values sent by value (`encode`/`decode`), where their memory lies (`extents`), and
arrays the grader keeps and serves a slice at a time (`ParentRows`).

The grader sends pickled requests (inputs it made itself); the learner's side answers with
*encoded* values: nested tuples of plain data that the grader rebuilds without running any code of
the learner's side (its unpickler refuses every global); an object of another type comes back as
an `Opaque` (type name, repr, attributes).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import pickle
import select
import struct
import sys
import time

import numpy as np

MAX_FRAME_BYTES = 512 * 2**20  # a reply larger than this is refused
# the values one reply may hold, counted as a walk over it meets them (a shared one each time)
MAX_NODES = 2**20
_OVER_BUDGET = f"it holds more than {MAX_NODES:,} values, counted as a walk meets them"


class ChannelClosed(Exception):
    """The other side ended (its process exited or closed the pipe)."""


class ChannelTimeout(Exception):
    """Nothing arrived in time."""


class Unsolicited(ChannelClosed):
    """The learner's side sent a frame the grader did not ask for, or one it cannot read: the
    grader ends that process (a fresh one serves the next question), so frames never shift."""


# --- transport ------------------------------------------------------------------------------------


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


class Channel:
    """Frames over a pair of file descriptors. `trusted`: unpickle with every global allowed (only
    where the sender is the grader); otherwise no global at all (the reply is encoded data).

    Every frame is `(number, message)`: the grader numbers its requests (`request`, `tell`), the
    learner's side answers with the number of the last frame it received (`next_request`,
    `answer`), and the grader accepts only an answer to its last request (`reply`)."""

    def __init__(self, read_fd: int, write_fd: int, *, trusted: bool):
        self.read_fd, self.write_fd, self.trusted = read_fd, write_fd, trusted
        self.seq = 0

    # the grader's side
    def request(self, message, timeout_s: float | None = None, *, compact: bool = False):
        """Send request `message`; the learner's side's answer to it."""
        self.tell(message, compact=compact)
        return self.reply(timeout_s)

    def tell(self, message, *, compact: bool = False) -> None:
        """Send `message`, numbered: the next answers must carry its number."""
        self.seq += 1
        self.send((self.seq, message), compact=compact)

    def reply(self, timeout_s: float | None = None) -> tuple:
        """The next frame, which must answer the last request: a tuple whose first item is a
        string. Raises Unsolicited otherwise."""
        frame = self.recv(timeout_s)
        if type(frame) is tuple and len(frame) == 2 and frame[0] == self.seq:
            message = frame[1]
            if type(message) is tuple and message and type(message[0]) is str:
                return message
        raise Unsolicited(
            f"your process sent the grader a message it did not ask for ({safe_text(frame)[:80]})"
        )

    # the learner's side
    def next_request(self):
        """The next request (its number is echoed by `answer`)."""
        self.seq, message = self.recv()
        return message

    def answer(self, message) -> None:
        self.send((self.seq, message))

    def send(self, obj, *, compact: bool = False) -> None:
        """Send `obj` (pickled). `compact`: arrays and CPU tensors travel as raw buffers after the
        pickle (protocol 5) and are rebuilt on them without a copy, so that the receiver holds
        each input once (a memory window subtracts `sent_bytes`)."""
        buffers: list = []
        stream = io.BytesIO()
        pickler = _Compact(stream, buffers) if compact else pickle.Pickler(stream, protocol=4)
        pickler.dump(obj)
        data = stream.getbuffer()
        raws = [b.raw() for b in buffers]
        self.sent_bytes = len(data) + sum(r.nbytes for r in raws)
        header = struct.pack(f"<QI{len(raws)}Q", len(data), len(raws), *(r.nbytes for r in raws))
        for part in (header, data, *raws):  # not joined: no copy of a large one
            view = memoryview(part).cast("B")
            while view:
                try:
                    written = os.write(self.write_fd, view)
                except OSError as exc:
                    raise ChannelClosed(str(exc)) from None
                view = view[written:]

    def _read(self, size: int, deadline: float | None) -> bytearray:
        out = bytearray(size)
        view, done = memoryview(out), 0
        while done < size:
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0 or not select.select([self.read_fd], [], [], wait)[0]:
                    raise ChannelTimeout()
            try:
                count = os.readv(self.read_fd, [view[done : done + (1 << 20)]])
            except OSError as exc:
                raise ChannelClosed(str(exc)) from None
            if not count:
                raise ChannelClosed("end of stream")
            done += count
        return out

    def recv(self, timeout_s: float | None = None):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        size, count = struct.unpack("<QI", self._read(12, deadline))
        sizes = struct.unpack(f"<{count}Q", self._read(8 * count, deadline)) if count < 64 else ()
        if count >= 64 or size + sum(sizes) > MAX_FRAME_BYTES:
            raise Unsolicited(
                f"your process sent the grader a frame of {size + sum(sizes):,} bytes in {count} "
                "parts, larger than it accepts"
            )
        data = self._read(size, deadline)
        buffers = [self._read(n, deadline) for n in sizes]
        if self.trusted:
            return pickle.loads(data, buffers=buffers)
        try:
            return _NoGlobals(io.BytesIO(data), buffers=buffers).load()
        except Exception as exc:  # noqa: BLE001 - any malformed frame
            raise Unsolicited(
                f"your process sent the grader a frame it cannot read ({type(exc).__name__})"
            ) from None


class _Compact(pickle.Pickler):
    """Pickles numpy arrays' and CPU tensors' data out of band (protocol 5)."""

    def __init__(self, stream, buffers: list):
        super().__init__(stream, protocol=5, buffer_callback=buffers.append)

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if (
            torch is not None
            and type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not obj.requires_grad
            and obj.dtype not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
            and obj.is_contiguous()
            and obj.untyped_storage().nbytes() == obj.nbytes  # owns its storage: no views of it
        ):
            return torch.from_numpy, (obj.numpy(),)  # rebuilt on the buffer, without a copy
        return NotImplemented


# --- values by value ------------------------------------------------------------------------------

_PLAIN = frozenset({int, float, bool, complex, str, bytes, type(None)})
_CONTAINERS = {list: "L", tuple: "U", set: "E", frozenset: "F"}


def encode(value, memo: dict | None = None, depth: int = 0):
    """`value` as nested tuples of plain data (see the module docstring); objects seen twice
    become references, so identity within one reply survives."""
    memo = {} if memo is None else memo
    if depth > 60:
        return ("X", "a structure nested more than 60 levels deep")
    if type(value) in _PLAIN:
        return ("P", value)
    key = id(value)
    if key in memo:
        return ("R", memo[key][0])
    memo[key] = (len(memo), value)  # keep value alive so ids stay unique
    if isinstance(value, ParentRows):
        return ("O", "ParentRows", repr(value), ())
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            return ("O", type(value).__name__, "a torch.Tensor subclass", ())
        t = value.detach()
        t = (t if t.layout == torch.strided else t.to_dense()).cpu()
        flat = t.contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return ("T", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return ("O", "ndarray", "a numpy array of Python objects", ())
        return ("A", value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, np.generic):
        return ("S", value.dtype.str, value.tobytes())
    if type(value) in _CONTAINERS:
        return (_CONTAINERS[type(value)], tuple(encode(v, memo, depth + 1) for v in value))
    if type(value) is dict:
        items = ((encode(k, memo, depth + 1), encode(v, memo, depth + 1)) for k, v in value.items())
        return ("D", tuple(items))
    attrs = ()
    with contextlib.suppress(Exception):
        fields = getattr(value, "__dict__", None)
        fields = list(fields.items())[:50] if isinstance(fields, dict) else []
        attrs = tuple((str(k), encode(v, memo, depth + 1)) for k, v in fields if isinstance(k, str))
    return ("O", type(value).__name__, safe_text(value)[:200], attrs)


def safe_text(value, text=repr) -> str:
    """`text(value)` (repr or str), or `<type name>` where the learner's __repr__ or __str__
    raises."""
    try:
        return text(value)
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
_BUILT = {"U": tuple, "E": set, "F": frozenset}


def decode(node, refs: list | None = None, budget: list | None = None):
    """The value `encode` described, rebuilt from plain data. Raises ValueError for a malformed
    node, or one whose value a walk would meet more than `MAX_NODES` times: every node counts,
    a reference as often as the value it refers to holds nodes (`budget`: [nodes left, {slot:
    nodes under it}], within one call), so a tiny frame of shared tuples cannot cost the grader
    exponential work, nor a tensor claim more bytes than it carries."""
    refs = [] if refs is None else refs
    budget = [MAX_NODES, {}] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(_OVER_BUDGET)
    if not isinstance(node, tuple) or not node or not isinstance(node[0], str):
        raise ValueError("malformed reply")
    kind, left = node[0], budget[0]
    if kind == "P":
        return node[1]
    if kind == "R":
        budget[0] -= budget[1].get(node[1], 0)
        if budget[0] < 0:
            raise ValueError(_OVER_BUDGET)
        return refs[node[1]]
    slot = len(refs)
    refs.append(None)
    if kind == "T":
        import torch

        _, dtype, shape, raw = node
        torch_dtype = getattr(torch, dtype)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype}")
        if type(shape) is not tuple or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"a tensor of shape {safe_text(shape)[:80]}")
        if len(raw) != math.prod(shape) * torch_dtype.itemsize:  # nothing claimed unsent
            raise ValueError(f"a tensor of shape {shape} with {len(raw):,} bytes of data")
        value = torch.empty(shape, dtype=torch_dtype)
        if raw:
            value = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch_dtype)
            value = value.reshape(shape).clone()
    elif kind == "A":
        _, dtype, shape, raw = node
        value = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    elif kind == "S":
        value = np.frombuffer(node[2], dtype=np.dtype(node[1]))[0]
    elif kind == "L":
        value = refs[slot] = []  # in refs before its items, which may refer to it
        value.extend(decode(v, refs, budget) for v in node[1])
    elif kind in _BUILT:  # tuples, sets, frozensets: made once their items are
        value = _BUILT[kind](decode(v, refs, budget) for v in node[1])
    elif kind == "D":
        value = refs[slot] = {}
        for k, v in node[1]:
            value[decode(k, refs, budget)] = decode(v, refs, budget)
    elif kind == "O":
        _, type_name, text, attrs = node
        cls = _OPAQUE_TYPES.setdefault(type_name, type(str(type_name), (Opaque,), {}))
        value = refs[slot] = cls(type_name, text)
        for name, v in attrs:
            with contextlib.suppress(Exception):
                setattr(value, name, decode(v, refs, budget))
        if budget[0] < 0:  # an attribute over the budget: not suppressed
            raise ValueError(_OVER_BUDGET)
    elif kind == "X":
        raise ValueError(node[1])
    else:
        raise ValueError(f"malformed reply node {kind!r}")
    refs[slot] = value
    budget[1][slot] = left - budget[0]  # what a reference to it costs
    return value


# --- where values lie in memory -------------------------------------------------------------------


def _span(value) -> tuple[int, int] | None:
    """(first byte, last byte + 1) of the memory under a tensor (its whole storage) or an array,
    read through the C types' own accessors (a patched torch.Tensor.untyped_storage, or an
    ndarray subclass, does not change it)."""
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):  # an exotic tensor (sparse, meta): no extent
        if torch is not None and isinstance(value, torch.Tensor):
            storage = torch._C.TensorBase.untyped_storage(value)
            start = torch._C.StorageBase.data_ptr(storage)
            return start, start + torch._C.StorageBase.nbytes(storage)
        if isinstance(value, np.ndarray):
            info = np.ndarray.__array_interface__.__get__(value)
            start, size = info["data"][0], np.dtype(info["typestr"]).itemsize
            shape, strides = info["shape"], np.ndarray.strides.__get__(value)
            if 0 in shape:
                return start, start
            low = start + sum(min(0, (n - 1) * st) for n, st in zip(shape, strides))
            high = start + sum(max(0, (n - 1) * st) for n, st in zip(shape, strides)) + size
            return low, high
    return None


def held(value, depth: int = 0, budget: list | None = None):
    """`value` and what it holds, first to last (list, tuple and dict items, 1,000 of each, four
    levels down), numbers, strings and None left out. Raises ValueError past `MAX_NODES` values
    visited (a shared list counted each time it is met: 1,000 lists of one list of 1,000...)."""
    budget = [MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(_OVER_BUDGET)
    if depth > 4 or isinstance(value, (int, float, complex, str, bytes, type(None))):
        return
    yield value
    items = value if type(value) in (list, tuple) else value.values() if type(value) is dict else ()
    for item in itertools.islice(items, 1000):
        yield from held(item, depth + 1, budget)


def extents(value) -> list[tuple[int, int]]:
    """The memory spans of the tensors and arrays in `value` (lists, tuples, dicts searched; none
    for a value `held` refuses to walk)."""
    with contextlib.suppress(ValueError):
        return [span for part in held(value) if (span := _span(part)) is not None]
    return []


# --- arrays the grader keeps ----------------------------------------------------------------------


class ParentRows:
    """A (S, D) array that stays in the grader's process (with `reads`, how often each row was
    served): the learner's code reads it a row slice at a time (`rows[a:b]`, at most `max_rows`
    rows), each asked of the grader. `shape`, `dtype`, `ndim` and `len()` work as for the array;
    only they, its limit and its index among the call's arguments cross the wire."""

    def __init__(self, array, max_rows: int):
        self._array, self.max_rows, self.index = array, int(max_rows), 0  # set by Remote.call
        self.shape, self.dtype = tuple(array.shape), str(array.dtype)
        self.ndim = len(self.shape)
        self.reads = np.zeros(self.shape[0], dtype=np.int64)  # how often each row was served
        self.ask = None  # the learner's side, during a call: ask(message) -> the grader's reply

    def __getstate__(self):  # what crosses the wire: not the array
        return {**self.__dict__, "_array": None, "reads": None, "ask": None}

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<rows of a {self.shape} array, read {self.max_rows} at a time>"

    def rows(self, start: int, stop: int):
        """The grader's side: rows start..stop-1, counted."""
        self.reads[start:stop] += 1
        return self._array[start:stop]

    def __getitem__(self, index):
        if isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None):
            index = index[0]  # rows[a:b, :] is rows[a:b]
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"index: only row slices such as k[a:b] are allowed, got {index!r}")
        start, stop, _ = index.indices(self.shape[0])
        stop = max(start, stop)
        if stop - start > self.max_rows:
            raise ValueError(
                f"index: read {stop - start} rows at once; at most {self.max_rows} (one tile) "
                "are allowed"
            )
        if self.ask is None:
            raise RuntimeError("these rows are served by the grader only during its call")
        return decode(self.ask(("rows", self.index, start, stop))[1])

    def __array__(self, *args, **kwargs):
        raise TypeError("read it in row slices (k[a:b]): the whole array is not here")
