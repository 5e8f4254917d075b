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
of an experiment whose only option is `--out`.
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
