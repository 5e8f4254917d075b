"""`python -m kvlib.memory CONFIG.json --seq-len N`: the cache report for one config."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlib.config import CONFIG_DIR, DTYPE_BITS, load_config
from kvlib.memory.equation import cache_report, format_bytes, kv_bytes_per_token


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.memory CONFIG.json --seq-len N [--batch B] [--cache-dtype D]`."""
    parser = argparse.ArgumentParser(
        prog="python -m kvlib.memory", description="KV-cache bytes for a Hugging Face config.json."
    )
    parser.add_argument(
        "config",
        help="path to config.json, or the name of a shipped config: "
        + ", ".join(p.stem for p in sorted(CONFIG_DIR.glob("*.json"))),
    )
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    parser.add_argument(
        "--cache-dtype",
        default=None,
        help=f"one of {', '.join(DTYPE_BITS)} (default: the config's dtype)",
    )
    args = parser.parse_args(argv)
    path = Path(args.config)
    if not path.exists() and (CONFIG_DIR / f"{args.config}.json").exists():
        path = CONFIG_DIR / f"{args.config}.json"
    try:
        config = load_config(path)  # read once, sized twice
        report = cache_report(config, args.seq_len, args.batch, args.cache_dtype)
        per_token = kv_bytes_per_token(config, args.cache_dtype)
    except (OSError, ValueError, TypeError) as exc:
        parser.error(str(exc))
    print(report.table())
    print(f"growth per token (before caps): {format_bytes(per_token)} ({per_token:,} bytes)")
    return 0
