"""kvlib.course.diagrams.sparse: the figure draws a box per page, the bound it plots is never
below a page's best score, the highest-bound pages are the ones marked read; arguments are
validated."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from kvlib.course.diagrams.sparse import page_bounds_figure  # noqa: E402


def test_boxes_bounds_and_choice():
    g = torch.Generator().manual_seed(0)
    keys, query = torch.randn(16, 2, generator=g), torch.tensor([1.0, -0.5])
    fig = page_bounds_figure(keys, query, block_size=4, budget=2)
    left, right = fig.axes[:2]
    boxes = [p for p in left.patches if isinstance(p, Rectangle)]
    assert len(boxes) == 4
    bars = [p.get_height() for p in right.patches]
    best = (keys.view(4, 4, 2) @ query).amax(dim=1)
    assert all(b >= s - 1e-9 for b, s in zip(bars, best.tolist()))
    read = sorted(range(4), key=lambda p: -bars[p])[:2]
    labels = [t.get_text() for t in right.get_xticklabels()]
    assert sorted(i for i, t in enumerate(labels) if "read" in t) == sorted(read)
    assert sum(b.get_linestyle() == "-" for b in boxes) == 2
    plt.close(fig)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(keys=torch.zeros(6, 2), query=torch.zeros(2)), "multiple of block_size"),
        (dict(keys=torch.zeros(8, 3), query=torch.zeros(2)), r"\(T, 2\)"),
        (dict(keys=torch.zeros(8, 2), query=torch.zeros(3)), "query"),
        (dict(keys=torch.zeros(8, 2), query=torch.zeros(2), budget=3), "budget"),
    ],
)
def test_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        page_bounds_figure(**kwargs)
