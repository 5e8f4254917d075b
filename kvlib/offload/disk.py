"""The disk tier (chapter 14): one safetensors file per block, never half-written once visible.

A block is written to a temporary name in the tier's directory, flushed to the device
(`os.fsync`), then renamed over its final name with `os.replace`, which POSIX and Windows make
atomic within a file system: a reader (or the next process, after a crash) sees either no file or
the whole file, never a prefix of one. A writer killed mid-write leaves only a temporary file,
which `reopen` deletes. Writing straight to the final name (`atomic=False`, for chapter 14's
pitfall) can leave a torn file under a block's name. safetensors refuses any prefix of a file (its
header gives the offsets of every byte, and the file must end where they do), so `reopen` skips
such a file: it deletes it, lists it in `DiskTier.skipped` with the reason, and warns
(`RuntimeWarning`); the tier opens with every whole block and stays usable, and the torn block is a
miss (its K/V is recomputed). A format without lengths in its header would read it back as a
shorter block instead.

The file format is safetensors (a JSON header of names, dtypes, shapes and offsets, then the raw
bytes; Hugging Face's format for weights), with the block's payload bytes in the header's metadata
so that reopening a directory counts bytes without reading the tensors. LRU order across restarts
is the files' modification times.

Deliberately not here: a file per layer or per chunk of blocks (LMCache's disk backend groups
tokens in chunks), compression, several processes writing one directory at once.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load, save

from kvlib.offload.store import TierIndex, payload_nbytes

__all__ = ["DiskTier", "write_block_file"]

SUFFIX = ".safetensors"
TEMP = ".tmp"


def write_block_file(path: Path, payload: dict[str, torch.Tensor], *, atomic: bool = True) -> None:
    """Write one block's payload to `path` as safetensors: to `path` + ".tmp.<pid>" first, then
    `os.replace` onto `path` (atomic); `atomic=False` writes `path` in place (torn on a crash)."""
    data = save(
        {name: t.detach().cpu().contiguous() for name, t in payload.items()},
        metadata={"nbytes": str(payload_nbytes(payload))},
    )
    target = Path(f"{path}{TEMP}.{os.getpid()}") if atomic else Path(path)
    with open(target, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)


class DiskTier(TierIndex):
    """Blocks as safetensors files `<key hex>.safetensors` in `directory` (created if absent);
    the same interface as `kvlib.offload.MemoryTier`, and durable: `reopen` rebuilds the index from
    the files, as a restarted process does, skipping (and listing in `skipped`) any that does not
    parse.

    Args:
        directory: where the files live (the tier owns it: it deletes stray temporary files).
        capacity_bytes: the tier holds at most this many payload bytes.
        bandwidth_bytes_per_s: the modelled speed of reading a block back to the device.
        atomic: write to a temporary name, then rename (False only to reproduce the pitfall).
    """

    durable = True

    def __init__(
        self,
        directory,
        capacity_bytes: int,
        bandwidth_bytes_per_s: float,
        *,
        name: str = "disk",
        atomic: bool = True,
    ):
        super().__init__(name, capacity_bytes, bandwidth_bytes_per_s)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.atomic = atomic
        self.reopen()

    def path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}{SUFFIX}"

    def reopen(self) -> None:
        """Rebuild the index from the directory: delete temporary files (writes a crash cut
        short), then list the block files, least recently used (oldest modification) first.

        A block file that does not parse (torn by a non-atomic write, or not written by a
        `DiskTier`) is skipped: deleted, recorded in `skipped` as (file name, reason), and
        reported with one `RuntimeWarning`; every other block stays readable."""
        for stray in self.directory.glob(f"*{TEMP}.*"):
            stray.unlink(missing_ok=True)
        found = []
        self.skipped: list[tuple[str, str]] = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                with safe_open(path, framework="pt") as f:
                    nbytes = int((f.metadata() or {})["nbytes"])
            except (SafetensorError, KeyError, ValueError) as error:
                self.skipped.append((path.name, f"{type(error).__name__}: {error}"))
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime_ns, path.name, nbytes))
        if self.skipped:
            warnings.warn(
                f"{self.directory}: skipped {len(self.skipped)} unreadable block file(s) (torn by "
                f"a crash?), deleted: {', '.join(name for name, _ in self.skipped)}",
                RuntimeWarning,
                stacklevel=2,
            )
        self.sizes: OrderedDict[bytes, int] = OrderedDict(
            (bytes.fromhex(name.removesuffix(SUFFIX)), nbytes) for _, name, nbytes in sorted(found)
        )
        self.used_bytes = sum(self.sizes.values())
        self._clock_ns = max((mtime for mtime, _, _ in found), default=0)

    def put(self, key: bytes, payload: dict[str, torch.Tensor]) -> None:
        write_block_file(self.path(key), payload, atomic=self.atomic)
        self._stamp(key)
        self.sizes[key] = payload_nbytes(payload)
        self.used_bytes += self.sizes[key]

    def get(self, key: bytes) -> dict[str, torch.Tensor]:
        """Read the block's file (KeyError if absent); it becomes most recently used."""
        if key not in self.sizes:
            raise KeyError(key)
        self.touch(key)
        return load(self.path(key).read_bytes())

    def touch(self, key: bytes) -> None:
        self.sizes.move_to_end(key)
        self._stamp(key)

    def _stamp(self, key: bytes) -> None:
        """Set the file's modification time past every other one's, so that the LRU order
        survives a restart (two writes within the clock's resolution would tie)."""
        self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
        os.utime(self.path(key), ns=(self._clock_ns, self._clock_ns))

    def pop(self, key: bytes) -> dict[str, torch.Tensor]:
        payload = load(self.path(key).read_bytes())
        self.path(key).unlink()
        self.used_bytes -= self.sizes.pop(key)
        return payload

    def lru_key(self) -> bytes:
        return next(iter(self.sizes))
