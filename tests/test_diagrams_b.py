"""The pictures of chapters 8-14 (`kvlib.course.diagrams`): each draws without error, and what it
draws follows its arguments and the library objects it is drawn from."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch

from kvlib.cache.block_table import shuffled_block_tables
from kvlib.cache.compaction_plans import plan_hole_filling, plan_repack
from kvlib.course.diagrams import (
    compaction,
    decode_kernel,
    eviction,
    offload,
    quantization,
    server,
    serving_engine,
)
from kvlib.quant import QuantScheme


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def gids(fig, prefix):
    """Artists of every axes of `fig` whose gid starts with `prefix`."""
    found = []
    for ax in fig.axes:
        for artist in ax.get_children():
            gid = artist.get_gid()
            if gid is not None and gid.startswith(prefix):
                found.append(gid)
    return found


def test_eviction_survivors_keeps_the_budget_with_sinks_window_and_heavy_hitters():
    scores = [5.0, 1, 1, 1, 0.1, 9.0, 0.2, 0.1, 0.3, 0.2, 0.1, 0.4]
    roles = eviction.survivor_roles(scores, budget=6, num_sinks=2, recent_fraction=0.5)
    assert roles["StreamingLLM"] == ["sink"] * 2 + ["evicted"] * 6 + ["recent window"] * 4
    # H2O: the last 3 (half of 6) always, then the 3 highest scores of the rest: 5, 0 and 1
    assert roles["H2O"][9:] == ["recent window"] * 3
    assert [t for t, r in enumerate(roles["H2O"]) if r == "heavy hitter"] == [0, 1, 5]
    fig = eviction.eviction_survivors(scores, budget=6, num_sinks=2)
    drawn = gids(fig, "")
    assert len(drawn) == 2 * len(scores)
    assert drawn.count("evicted") == 2 * (len(scores) - 6)
    assert drawn.count("sink") == 2 and drawn.count("heavy hitter") == 3


def test_eviction_survivors_rejects_a_budget_that_holds_everything():
    with pytest.raises(ValueError, match="scores"):
        eviction.eviction_survivors([1.0, 2.0, 3.0], budget=3)
    with pytest.raises(ValueError, match="budget"):
        eviction.eviction_survivors([1.0] * 10, budget=4, num_sinks=4)


def test_compaction_passes_draws_the_plans_moves_and_freed_blocks():
    live = [t % 3 == 0 for t in range(24)]  # 8 survivors in 6 blocks of 4: none freeable
    fig = compaction.compaction_passes(live, block_size=4)
    assert gids(fig, "move").count("move") == len(plan_repack(live)) + len(plan_hole_filling(live))
    # the two passes free blocks 2-5 (8 survivors fill 2 blocks): 4 blocks x 4 slots each
    assert gids(fig, "slot-free").count("slot-free") == 2 * 4 * 4
    assert len(gids(fig, "slot-")) == 3 * 24
    # after eviction, every one of the 16 dead slots is drawn dead; none is free
    assert gids(fig, "slot-dead").count("slot-dead") >= 16
    positions = compaction._after(live, plan_hole_filling(live))
    assert sorted(p for p in positions if p >= 0) == [t for t in range(24) if live[t]]
    assert positions[8:] == [-1] * 16


def test_compaction_passes_rejects_no_slots():
    with pytest.raises(ValueError, match="live"):
        compaction.compaction_passes([], 4)
    with pytest.raises(ValueError, match="block_size"):
        compaction.compaction_passes([True], 0)


def test_scale_groups_draws_one_outline_per_scale():
    schemes = [
        QuantScheme("int4", False, "channels"),  # per token: S scales
        QuantScheme("int4", False, "tokens", 4),  # per channel, groups of 4 tokens: S/4 * D
        QuantScheme("int8", True, "channels", 2),  # per token, groups of 2 channels: S * D/2
    ]
    fig = quantization.scale_groups(schemes, num_tokens=8, head_dim=6)
    counts = [sum(1 for a in ax.get_children() if a.get_gid() == "scale-group") for ax in fig.axes]
    assert counts == [8, 2 * 6, 8 * 3]


def test_kivi_residual_matches_the_quantized_cache():
    keys = QuantScheme("int2", False, "tokens", 8)
    values = QuantScheme("int2", False, "channels", 8)
    counts = quantization.kivi_layout(keys, values, num_tokens=45, residual_length=6)
    # keys leave the residual in whole groups of 8 beyond R = 6: 32 quantized, 13 exact;
    # values one token at a time: 39 and 6
    assert counts == {"keys": (32, 13), "values": (39, 6)}
    fig = quantization.kivi_residual(keys, values, 45, 6)
    assert gids(fig, "quantized").count("quantized") == 32 + 39
    assert gids(fig, "exact").count("exact") == 13 + 6
    assert gids(fig, "key-group").count("key-group") == 4


def test_decode_grid_draws_a_program_per_sequence_head_and_split():
    lengths = [100, 20]
    tables, _ = shuffled_block_tables(lengths, 16, generator=torch.Generator().manual_seed(0))
    fig = decode_kernel.decode_grid(tables, torch.tensor(lengths), 2, 4, 16, 16)
    # 2 sequences x 2 KV heads x 4 splits; the 20-token sequence fills 1 split of 16 + 1 of 4
    assert len(gids(fig, "program")) == 16
    assert gids(fig, "program-empty").count("program-empty") == 2 * 2
    assert gids(fig, "block").count("block") == 7 and gids(fig, "tile").count("tile") == 7
    assert decode_kernel.split_ranges(100, 4, 16) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    with pytest.raises(ValueError, match="seq_lens"):
        decode_kernel.decode_grid(tables, torch.tensor([200, 20]), 2, 4, 16, 16)


def test_engine_steps_draws_each_requests_chunk_within_the_budget():
    steps = [[("A", 16)], [("A", 8), ("B", 6), ("C", 2)], [("A", 1), ("B", 1)]]
    fig = serving_engine.engine_steps(steps, token_budget=16)
    assert gids(fig, "chunk").count("chunk") == 6
    assert gids(fig, "unused").count("unused") == 1  # only the last step leaves room
    assert gids(fig, "stage").count("stage") == 4
    with pytest.raises(ValueError, match="steps\\[0\\]"):
        serving_engine.engine_steps([[("A", 17)]], token_budget=16)


def test_request_life_draws_one_event_per_piece_and_done():
    fig = server.request_life([" v2", " SET", " k4", " v16"])
    assert gids(fig, "sse").count("sse") == 5 and gids(fig, "step").count("step") == 4
    with pytest.raises(ValueError, match="pieces"):
        server.request_life([])


def test_tier_walk_stops_at_the_first_miss():
    fig = offload.tier_walk(["device", "host", "disk", None, "disk"])
    drawn = gids(fig, "")
    assert drawn.count("hit-device") == drawn.count("hit-host") == drawn.count("hit-disk") == 1
    assert drawn.count("miss") == 2  # the missing block and the stored one after it
    with pytest.raises(ValueError, match="found_in\\[0\\]"):
        offload.tier_walk(["gpu"])
