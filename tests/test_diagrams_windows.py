"""Chapter 17's picture (`kvlib.course.diagrams.windows`): the ring's slots are read back from a
real RingCache and follow slot = position mod W; the positions and pages are coloured by what the
next query can still see."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from kvlib.course.diagrams.windows import ring_and_pages, ring_contents


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def gids(fig, prefix: str) -> list[str]:
    return [
        p.get_gid() for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(prefix)
    ]


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("num_positions", [0, 1, 5, 8, 9, 13, 30])
def test_ring_contents_hold_the_last_w_positions_at_position_mod_w(window, num_positions):
    slots = ring_contents(window, num_positions)
    assert len(slots) == window
    held = range(max(0, num_positions - window), num_positions)
    assert sorted(p for p in slots if p is not None) == list(held)
    for slot, position in enumerate(slots):
        assert position is None or position % window == slot


def test_the_picture_colours_what_the_next_query_sees():
    fig = ring_and_pages(8, 13, block_size=4, freed=[0])
    assert gids(fig, "position-live").count("position-live") == 7  # 6..12 (13 sees 6..13)
    assert gids(fig, "position-dead").count("position-dead") == 6  # 0..5
    assert gids(fig, "slot-next") == ["slot-next"]  # slot 13 mod 8 = 5
    assert len(gids(fig, "slot")) == 8
    assert gids(fig, "page-freed") == ["page-freed"] and len(gids(fig, "page-live")) == 3
    assert gids(fig, "page-unwritten") == ["page-unwritten"]  # page 3's slots 13, 14, 15


def test_without_pages_there_is_no_page_row_and_bad_sizes_are_refused():
    assert gids(ring_and_pages(4, 6), "page-") == []
    with pytest.raises(ValueError, match="window"):
        ring_and_pages(0, 6)
    with pytest.raises(ValueError, match="num_positions"):
        ring_and_pages(4, 0)
    with pytest.raises(ValueError, match="block_size"):
        ring_and_pages(4, 6, block_size=0)
