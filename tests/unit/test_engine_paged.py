"""Paged KV layouts: every block of every layout round-trips byte for byte (CPU tensors)."""

from __future__ import annotations

import pytest

from kvpool_client.engines.paged import LayoutError, PagedLayout

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

#: vLLM's physical orders of the logical [L, B, H, N, C] axes (RFC 42082's layouts).
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
          "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
SHAPE = (3, 7, 2, 4, 6)  # layers, blocks, heads, tokens, K|V content


def make_cache(order: tuple[int, ...], fill: bool = True, dtype: object = None) -> list[object]:
    """Per-layer [B, H, N, C] views of one allocation laid out in ``order``."""
    phys = [SHAPE[d] for d in order]
    n = 1
    for x in phys:
        n *= x
    raw = (torch.randn(n, dtype=dtype or torch.bfloat16) if fill else torch.zeros(n, dtype=dtype or torch.bfloat16))
    inv = [order.index(d) for d in range(5)]
    logical = raw.reshape(phys).permute(*inv)
    return [logical[layer] for layer in range(SHAPE[0])]


def page_bytes(view: object) -> object:
    """A block's page of one layer in its physical byte order."""
    perm = sorted(range(view.dim()), key=lambda d: -view.stride(d))  # type: ignore[attr-defined]
    return view.permute(*perm).contiguous().view(torch.uint8).flatten()  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_gather_is_each_layers_page_in_layer_order(name: str) -> None:
    layers = make_cache(ORDERS[name])
    layout = PagedLayout(layers, SHAPE[1])
    ids = [5, 0, 3]
    rows = layout.gather(ids)
    expected = torch.stack([torch.cat([page_bytes(layer[b]) for layer in layers]) for b in ids])
    assert rows.dtype == torch.uint8 and torch.equal(rows, expected)
    assert layout.block_bytes == expected.shape[1]


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_scatter_restores_blocks_and_touches_no_other(name: str) -> None:
    src = make_cache(ORDERS[name])
    dst = make_cache(ORDERS[name], fill=False)
    ids = [6, 2]
    PagedLayout(dst, SHAPE[1]).scatter(ids, PagedLayout(src, SHAPE[1]).gather(ids))
    for s, d in zip(src, dst):
        for b in range(SHAPE[1]):
            if b in ids:
                assert torch.equal(s[b], d[b])
            else:
                assert not d[b].any()


def test_block_outermost_layouts_are_one_run_per_block() -> None:
    assert len(PagedLayout(make_cache(ORDERS["BLNHC"]), SHAPE[1]).segments) == 1
    assert len(PagedLayout(make_cache(ORDERS["LBNHC"]), SHAPE[1]).segments) == SHAPE[0]
    assert len(PagedLayout(make_cache(ORDERS["LHBNC"]), SHAPE[1]).segments) == SHAPE[0] * SHAPE[2]


def test_a_layout_is_not_the_same_bytes_as_another() -> None:
    """The layout's name belongs in the fingerprint: two layouts give different rows."""
    base = torch.randn(SHAPE, dtype=torch.float32)
    a = [base[i] for i in range(SHAPE[0])]
    phys = base.permute(1, 0, 3, 2, 4).contiguous()  # BLNHC, same values
    b = [phys.permute(1, 0, 3, 2, 4)[i] for i in range(SHAPE[0])]
    ra, rb = PagedLayout(a, SHAPE[1]).gather([1]), PagedLayout(b, SHAPE[1]).gather([1])
    assert ra.shape == rb.shape and not torch.equal(ra, rb)


def test_kernel_blocks_group_into_engine_blocks() -> None:
    cache = torch.randn(2, 12, 2, 4, 8)  # 12 kernel blocks = 4 engine blocks of 3
    layers = [cache[i] for i in range(2)]
    layout = PagedLayout(layers, 4)
    rows = layout.gather([1])
    expected = torch.cat([layers[i][3:6].contiguous().view(torch.uint8).flatten() for i in range(2)])
    assert torch.equal(rows[0], expected)


def test_bad_caches_are_refused() -> None:
    with pytest.raises(LayoutError):
        PagedLayout([], 4)
    with pytest.raises(LayoutError):
        PagedLayout([torch.zeros(5, 2, 2)], 4)  # 5 rows are not 4 blocks
    with pytest.raises(LayoutError):
        PagedLayout([torch.zeros(4, 2, 2)], 4).gather([4])
    layout = PagedLayout([torch.zeros(4, 2, 2)], 4)
    with pytest.raises(LayoutError):
        layout.scatter([0], torch.zeros(1, 3, dtype=torch.uint8))
