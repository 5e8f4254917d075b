"""The command line of an experiment that writes one results file:
`python -m kvlib.experiments.NAME [--out FILE]`, the committed file by default."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def run(
    name: str,
    description: str,
    default_out: str,
    record: Callable[[str], object],
    argv: list[str] | None = None,
    *,
    threads: int | None = None,
) -> int:
    """Parse `argv`, set torch's thread count if `threads` is given (the recordings name theirs),
    run `record(out)`, which writes the file, and print what it returns: a summary line as it is,
    a list of rows as their count, anything else as the path written. `description` is the help's
    text (an experiment passes its module docstring). Returns the exit status, 0."""
    parser = argparse.ArgumentParser(
        prog=f"python -m kvlib.experiments.{name}", description=description
    )
    parser.add_argument(
        "--out", default=default_out, help="the file to write (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    result = record(args.out)
    if isinstance(result, list):
        result = f"wrote {len(result)} rows to {args.out}"
    elif not isinstance(result, str):
        result = f"wrote {args.out}"
    print(result)
    return 0


def write_rows(path, rows: list[dict]) -> list[dict]:
    """Write `rows` (dicts with the same keys, in column order) to the CSV file `path`, with a
    header; returns them."""
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows
