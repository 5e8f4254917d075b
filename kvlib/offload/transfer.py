"""KV transfer between a prefill engine and a decode engine (chapter 14), over ZeroMQ.

Disaggregated serving (DistServe, Splitwise, Mooncake) runs prompts on prefill engines and token
generation on decode engines, and ships each request's K/V from one to the other. Here both are
chapter 12's engine with chapter 14's tiers, in two processes on one machine:

1. the decode side sends the prompt's token ids (a ZeroMQ REQ socket);
2. the prefill process (`serve`, a REP socket) runs the prompt through its engine and replies
   with the prompt's full blocks, read from its pool by their chained hashes (`export_blocks`):
   one multipart message, a JSON header (the engine's salt, the blocks' salted keys, the first
   token) and one safetensors frame per block (K and V of every layer; codes and scales for a
   quantized cache);
3. the decode side checks the salt (its own engine's: same model, dtype, scheme, RoPE, block
   size) and puts the blocks into its store (`import_blocks`); its engine admits the request as
   a prefix hit, promotes the blocks into its pool and computes the prompt's tail (below), then
   decodes.

What the decode side recomputes: the engine admits a request through its prefix lookup, which only
ever covers full blocks and always leaves the last prompt token to compute (chapter 7), so it uses
(n - 1) // block_size shipped blocks of an n-token prompt and computes the other
n - block_size · ((n - 1) // block_size) tokens: between 1 and `block_size` of them, a whole block
when n is a multiple of `block_size` (a 64-token prompt ships 3 blocks of 16 and recomputes 16
tokens). The bytes shipped are `full blocks · block_bytes` plus safetensors' headers, measured in
tests and in the chapter.

Deliberately not here: RDMA or NVLink (production uses NIXL, Mooncake's transfer engine, UCX),
layer-by-layer streaming overlapped with the prefill, a scheduler that routes requests.

Run the prefill side: `python -m kvlib.offload.transfer --model course` (prints its port).
"""

from __future__ import annotations

import argparse
import json
import sys

from safetensors.torch import load, save

from kvlib.cache.block_pool import hash_block_tokens
from kvlib.offload.engine import read_block
from kvlib.offload.keys import block_key, engine_salt
from kvlib.offload.store import TieredStore

__all__ = ["export_blocks", "import_blocks", "pack_blocks", "request_prefill", "serve"]


def export_blocks(engine, token_ids) -> list[tuple[bytes, dict]]:
    """(salted key, payload) of each leading full block of `token_ids` that `engine`'s device
    prefix cache holds, at most (n - 1) // block_size of them (what a prefix hit can use)."""
    manager, block_size = engine.manager, engine.config.block_size
    salt = getattr(engine, "salt", None) or engine_salt(
        engine.model, kv_scheme=engine.config.kv_scheme, block_size=block_size
    )
    blocks, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        block_id = manager.pool.lookup(parent)
        if block_id is None:
            break
        blocks.append((block_key(salt, parent), read_block(engine.storage, block_id)))
    return blocks


def pack_blocks(salt: bytes, blocks, **header) -> list[bytes]:
    """The wire format: a JSON header (the salt, the keys, and `header`'s fields), then one
    safetensors frame per block."""
    head = dict(header, salt=salt.hex(), keys=[key.hex() for key, _ in blocks])
    return [json.dumps(head).encode()] + [save(dict(payload)) for _, payload in blocks]


def import_blocks(frames: list[bytes], store: TieredStore, salt: bytes) -> dict:
    """Put the blocks of a `pack_blocks` message into `store`; return its header, with `nbytes`,
    the bytes of the frames received.

    Raises:
        ValueError: the sender's salt is not `salt` (its K/V would be wrong here)."""
    header = json.loads(frames[0])
    if bytes.fromhex(header["salt"]) != salt:
        raise ValueError(
            "frames: the prefill engine's salt differs from the decode engine's (another model, "
            "dtype, quantization scheme, RoPE or block size): its blocks would give wrong tokens"
        )
    for key, frame in zip(header["keys"], frames[1:]):
        store.put(bytes.fromhex(key), load(frame))
    header["nbytes"] = sum(len(frame) for frame in frames)
    return header


def request_prefill(socket, token_ids, kv_scheme: str | None = None) -> list[bytes]:
    """Send a prompt to a `serve` process over a connected ZeroMQ REQ socket; return its reply's
    frames."""
    socket.send_json(dict(prompt=[int(t) for t in token_ids], kv_scheme=kv_scheme))
    return socket.recv_multipart()


def serve(model, address: str = "tcp://127.0.0.1", **engine_options) -> None:
    """The prefill side: bind a REP socket at `address` on a free port, print the port, then for
    each request `{"prompt": [...], "kv_scheme": None | "int8" | ...}` run the prompt (one sampled
    token) through an engine for that scheme and reply with its full blocks (`pack_blocks`, header
    field `first_token`); `{"stop": true}` ends it."""
    import zmq

    from kvlib.engine import SamplingParams
    from kvlib.offload.engine import OffloadEngine
    from kvlib.offload.store import MemoryTier
    from kvlib.quant import QuantScheme

    engines = {}
    with zmq.Context() as context, context.socket(zmq.REP) as socket:
        port = socket.bind_to_random_port(address)
        print(port, flush=True)
        while True:
            message = socket.recv_json()
            if message.get("stop"):
                socket.send_multipart([b"{}"])
                return
            scheme = message.get("kv_scheme")
            if scheme not in engines:
                store = TieredStore([MemoryTier("host", 0, 1.0)])  # the prefill side keeps none
                engines[scheme] = OffloadEngine(
                    model,
                    store=store,
                    kv_scheme=None if scheme is None else QuantScheme(scheme),
                    **engine_options,
                )
            engine, prompt = engines[scheme], message["prompt"]
            (output,) = engine.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            blocks = export_blocks(engine, prompt)
            socket.send_multipart(
                pack_blocks(engine.salt, blocks, first_token=output.output_token_ids[0])
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("course", "smollm2"), default="course")
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.model == "course":
        from kvlib.loaders.course_model import load_course_model

        model = load_course_model()
    else:
        from kvlib.loaders.smollm2 import load_smollm2

        model, _ = load_smollm2()
    serve(
        model,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.num_blocks * args.block_size,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
