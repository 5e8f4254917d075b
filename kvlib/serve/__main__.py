"""`python -m kvlib.serve --model {course,smollm2} [--host 127.0.0.1] [--port 8000]
[--api-key KEY] [--allow-no-auth] [--max-queued-requests 256] [--max-body-bytes 2097152]` and
the engine's options: serve a model with an
OpenAI-compatible API (chapter 13). `--speculative-config '{"method": "ngram",
"num_speculative_tokens": 3}'` (JSON, as vLLM's) decodes requests speculatively (greedy and
sampled; not those asking for logprobs).

`--api-key` (or the environment variable `KVLIB_API_KEY`, as vLLM reads `VLLM_API_KEY`) makes every
`/v1/*` request need `Authorization: Bearer KEY`; `/health` and `/metrics` stay open. Without a
key the server refuses a host beyond loopback (e.g. `--host 0.0.0.0`) unless `--allow-no-auth`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from kvlib.serve.models import MODEL_NAMES


def build_engine(served, args):
    """The `LLMEngine` the options describe."""
    from kvlib.engine import LLMEngine

    kv_scheme = None
    if args.kv_scheme == "int8":
        from kvlib.quant import QuantScheme

        kv_scheme = QuantScheme("int8")  # per-token scales
    return LLMEngine(
        served.model,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=min(args.max_model_len, served.max_model_len),
        policy=args.policy,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_scheme=kv_scheme,
        speculative_config=args.speculative_config,
    )


def speculative_config(text: str):
    """`--speculative-config`'s value: a JSON object of `SpeculativeConfig`'s fields, checked
    here so that a bad one stops the command line before any model loads."""
    from kvlib.engine.speculative import SpeculativeConfig

    fields = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    try:
        spec = json.loads(text)
        if not isinstance(spec, dict):
            raise TypeError(f"a JSON {type(spec).__name__}")
        return SpeculativeConfig(**spec)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object with fields among {fields}, got {text!r} ({error})"
        ) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvlib.serve", description=__doc__)
    p.add_argument("--model", choices=MODEL_NAMES, default="course")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-blocks", type=int, default=512, help="KV pool blocks")
    p.add_argument("--block-size", type=int, default=16, help="token slots per block")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget per step")
    p.add_argument("--max-model-len", type=int, default=1024, help="prompt + output tokens")
    p.add_argument("--policy", choices=("continuous", "static"), default="continuous")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--kv-scheme", choices=("none", "int8"), default="none")
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' (default: off)',
    )
    p.add_argument("--max-queued-requests", type=int, default=256, help="429 beyond this")
    p.add_argument(
        "--max-body-bytes", type=int, default=2**21, help="413 for a request body beyond this"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $KVLIB_API_KEY, if set)",
    )
    p.add_argument(
        "--allow-no-auth",
        action="store_true",
        help="serve without an API key on a host beyond loopback (anyone reaching it may use it)",
    )
    return p


def parse_options(argv=None, environ=None) -> argparse.Namespace:
    """The command line's options, `api_key` taken from `KVLIB_API_KEY` when `--api-key` is not
    given; exits with status 2 and the reason (argparse's error) for an empty key or a host
    beyond loopback without a key or `--allow-no-auth`."""
    from kvlib.serve.auth import check_bind

    p = parser()
    args = p.parse_args(argv)
    environ = os.environ if environ is None else environ
    if args.api_key is None:
        args.api_key = environ.get("KVLIB_API_KEY") or None
    if args.api_key is not None and not args.api_key.strip():
        p.error("--api-key: expected a non-empty key")
    try:
        check_bind(args.host, args.api_key, args.allow_no_auth)
    except PermissionError as error:
        p.error(str(error))
    return args


def main(argv=None) -> None:
    import uvicorn

    from kvlib.serve.models import load_served_model
    from kvlib.serve.server import create_app

    args = parse_options(argv)
    served = load_served_model(args.model)
    app = create_app(
        served,
        build_engine(served, args),
        max_queued_requests=args.max_queued_requests,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
