"""Chapter 13's picture: one streamed request's life through the server.

`request_life` draws a sequence diagram with four lanes (the client, the HTTP side on its
asyncio event loop, the engine loop's thread, the engine): the POST, validation and
tokenization, the command put into the engine loop's inbox, then per generated token one
engine step, the output handed back to the event loop (`call_soon_threadsafe`), incremental
detokenization with stop-string hold-back, and one server-sent event with the text that token
added; `data: [DONE]` last. The pieces drawn are the ones given (a real stream's), so the picture
has as many events as the stream had. The shape follows vLLM's OpenAI server (`AsyncLLM`,
`EngineCore`, `OutputProcessor`), which `kvlib.serve` mirrors. It draws; it measures nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch

LANES = ("client", "HTTP (asyncio)", "engine loop thread", "engine")


def request_life(pieces: Sequence[str]) -> Figure:
    """Draw one streamed completion through the server, one event per piece of text.

    Args:
        pieces: the text each streamed chunk carried, in order (at least one).
    Returns:
        the Figure; every message is an arrow: the server-sent events (`gid` "sse") are one per
        piece plus `[DONE]`; engine steps (`gid` "step") one per piece.
    Raises:
        ValueError: `pieces` empty; TypeError: a piece that is not a str.
    """
    if not pieces:
        raise ValueError("pieces: expected at least one streamed piece of text, got none")
    for i, piece in enumerate(pieces):
        if not isinstance(piece, str):
            raise TypeError(f"pieces[{i}]: expected str, got {type(piece).__name__}")
    lane_x = {name: 2.6 * i for i, name in enumerate(LANES)}
    num_rows = 4 + 3 * len(pieces) + 1
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.24 * num_rows))
    top = num_rows

    def message(src, dst, row, text, gid, color="0.2"):
        y = top - row
        ax.add_patch(
            FancyArrowPatch(
                (lane_x[src], y),
                (lane_x[dst], y),
                arrowstyle="-|>",
                mutation_scale=8,
                lw=0.8,
                color=color,
                gid=gid,
            )
        )
        ax.text(
            (lane_x[src] + lane_x[dst]) / 2, y + 0.12, text, ha="center", fontsize=6.5, color=color
        )

    def note(lane, row, text):
        ax.text(lane_x[lane] + 0.1, top - row, text, va="center", fontsize=6.5, color="0.35")

    for name, x in lane_x.items():
        ax.plot([x, x], [0.3, top + 0.5], color="0.75", lw=1, zorder=0)
        ax.text(x, top + 0.8, name, ha="center", fontsize=8.5, weight="bold")
    message("client", "HTTP (asyncio)", 1, "POST /v1/completions", "http")
    note("HTTP (asyncio)", 2, "validate the body (4xx on error); tokenize the prompt")
    message("HTTP (asyncio)", "engine loop thread", 3, "add (through the inbox)", "inbox")
    row = 4
    for i, piece in enumerate(pieces):
        message("engine loop thread", "engine", row, f"step(): token {i + 1}", "step")
        message(
            "engine loop thread",
            "HTTP (asyncio)",
            row + 1,
            "output (call_soon_threadsafe)",
            "output",
            color="0.45",
        )
        note("HTTP (asyncio)", row + 1.45, "detokenize, hold back a possible stop string")
        message(
            "HTTP (asyncio)", "client", row + 2, f"data: text {piece!r}", "sse", color="tab:blue"
        )
        row += 3
    message("HTTP (asyncio)", "client", row, "data: [DONE]", "sse", color="tab:blue")
    ax.set_xlim(-0.8, lane_x["engine"] + 1.0)
    ax.set_ylim(0, top + 1.2)
    ax.axis("off")
    ax.set_title(
        f"One streamed request: {len(pieces)} tokens, {len(pieces) + 1} server-sent "
        "events (time runs down)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
