"""The command lines of the experiments and of `.ci/gpu_check.py`, each written as one table: an
option's flag and either its help (an on/off switch) or `argparse`'s keywords for it.

    parser = options.parser("python -m kvlib.experiments.NAME", "What it measures.", {
        "--out": {"default": "results/NAME.csv", "help": "CSV to write"},
        "--quick": "a handful of shapes only",
    })
    args = parser.parse_args(argv)
    options.need_cuda(parser, "NAME needs a CUDA GPU (--quick ...)", unless=args.quick)

It imports `argparse` only: `.ci/gpu_check.py` loads it by its path, before the set-up that
installs what `import kvlib` needs (numpy). `kvlib.experiments.cli.run` is the whole command line
of an experiment whose only option is `--out`; `run_with_quick` (a CPU recording with a quick
mode) and `run_training` (a course-sized model trained, then measured) are two others, shared by
the experiments of that shape.
"""

from __future__ import annotations

import argparse


def parser(
    prog: str | None, description: str, table: dict[str, str | dict]
) -> argparse.ArgumentParser:
    """An `argparse` parser named `prog` (None: the script's file name) with the options of
    `table`, in its order: a flag with a string is an on/off switch (`store_true`) whose help that
    string is; a flag with a dict is `add_argument(flag, **dict)`."""
    made = argparse.ArgumentParser(prog=prog, description=description)
    for flag, option in table.items():
        if isinstance(option, str):
            made.add_argument(flag, action="store_true", help=option)
        else:
            made.add_argument(flag, **option)
    return made


def need_cuda(parser: argparse.ArgumentParser, message: str, *, unless: bool = False) -> None:
    """Stop with the usage and `message` (`parser.error`, exit status 2) where torch sees no CUDA
    GPU, unless `unless` (the option that runs without one was given). Imports torch."""
    import torch

    if not torch.cuda.is_available() and not unless:
        parser.error(message)


def run_with_quick(
    name: str, description: str, default_out: str, quick_help: str, record, argv=None
) -> int:
    """`python -m kvlib.experiments.NAME [--out FILE] [--quick] [--threads N]`: torch's thread
    count set (default 2, as the CPU recordings ran), then `record(FILE, quick=False)` writes the
    file, or `--quick` runs `record(None, quick=True)`, which prints only (`quick_help` says what
    it runs). Returns the exit status, 0."""
    made = parser(
        f"python -m kvlib.experiments.{name}",
        description,
        {
            "--out": {"default": default_out, "help": "CSV to write"},
            "--quick": quick_help,
            "--threads": {"type": int, "default": 2, "help": "torch threads (default 2)"},
        },
    )
    args = made.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rows = record(None if args.quick else args.out, quick=args.quick)
    if not args.quick:
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0


def run_training(
    name: str, description: str, default_out: str, weights: str, record, argv=None
) -> int:
    """`python -m kvlib.experiments.NAME [--out FILE] [--weights DIR] [--skip-training]
    [--threads N] [--scale F]`: `record(FILE, weights=DIR, train_model=..., threads=N, scale=F)`
    trains a course-sized model into DIR (default: its shipped checkpoint, `weights` names it)
    with the course model's recipe, the curriculum scaled by F, and measures it. Returns 0."""
    from pathlib import Path

    made = parser(
        f"python -m kvlib.experiments.{name}",
        description,
        {
            "--out": {"default": default_out, "help": "the CSV to write"},
            "--weights": {
                "type": Path,
                "default": None,
                "help": "the checkpoint folder to train into and measure (default: the shipped "
                f"{weights})",
            },
            "--skip-training": "measure the checkpoint there instead of training it again",
            "--threads": {"type": int, "default": 2, "help": "training threads (default 2)"},
            "--scale": {
                "type": float,
                "default": 1.0,
                "help": "multiply the curriculum's steps (0.05: a smoke run, with --weights "
                "pointing elsewhere than the shipped checkpoint)",
            },
        },
    )
    args = made.parse_args(argv)
    rows = record(
        args.out,
        weights=args.weights,
        train_model=not args.skip_training,
        threads=args.threads,
        scale=args.scale,
    )
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0
