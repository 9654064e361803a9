"""host_empty: host pools on plain or 2 MiB pages, and the pages the kernel says are under them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hisparse.memory.host_memory import HUGE_PAGE_BYTES, host_empty, huge_page_status

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists(), reason="this kernel has no transparent huge pages")


@pytest.mark.parametrize("pages", ["huge", "small"])
def test_host_empty_is_an_ordinary_writable_tensor(pages):
    shape = (HUGE_PAGE_BYTES // 256 * 3, 128)  # 3 huge pages of bfloat16 rows
    t = host_empty(shape, torch.bfloat16, pages=pages)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu"
    rows = torch.arange(shape[0], dtype=torch.float32).unsqueeze(1).expand(shape)
    t.copy_(rows)
    assert torch.equal(t[::4097, 0].float(), rows[::4097, 0].to(torch.bfloat16).float())


def test_a_view_keeps_the_mapping_alive():
    t = host_empty((HUGE_PAGE_BYTES // 4, 2), torch.float32, pages="huge")
    t.fill_(3.0)
    tail = t[-10:]
    del t
    assert torch.equal(tail, torch.full((10, 2), 3.0))


@needs_thp
def test_huge_pages_are_asked_for():
    """Only the huge kind is checked for the advice: plain `torch.empty` memory may sit in a heap region
    someone else advised (NumPy advises its own large arrays), so "small" means "not asked for"."""
    huge = host_empty((8 * HUGE_PAGE_BYTES,), torch.uint8, pages="huge")
    small = host_empty((8 * HUGE_PAGE_BYTES,), torch.uint8, pages="small")
    huge.fill_(1), small.fill_(1)
    assert huge_page_status(huge).advised
    for t in (huge, small):  # the kernel backs whole 2 MiB pages, and the figure is read in bytes, not kB
        assert huge_page_status(t).huge_bytes % HUGE_PAGE_BYTES == 0


def test_unknown_page_kind_is_refused():
    with pytest.raises(ValueError, match="pages must be one of huge, small"):
        host_empty((4,), torch.uint8, pages="giant")


def pools_on(pages: str | None):
    from hisparse.formats.index_key import IndexKeyFormat
    from hisparse.memory.hisparse_config import HiSparseConfig
    from hisparse.memory.hisparse_pools import HiSparsePools

    config = HiSparseConfig(top_k=16) if pages is None else HiSparseConfig(top_k=16, host_pages=pages)
    return HiSparsePools(num_layers=2, row_width=384, row_dtype=torch.bfloat16, index_key=IndexKeyFormat("int8", 64),
                         config=config, budget_bytes=8 << 20, max_requests=4, max_context=4096)


@needs_thp
def test_the_hisparse_host_pool_asks_for_huge_pages_when_configured():
    pools = pools_on("huge")
    assert pools.host_kv.nbytes >= HUGE_PAGE_BYTES
    assert huge_page_status(pools.host_kv).advised


def test_the_hisparse_host_pool_takes_plain_pages_by_default(monkeypatch):
    """First touch of an advised mapping compacts memory in the faulting thread (host_memory): the default
    pool must not ask for it."""
    import hisparse.memory.hisparse_pools as hisparse_pools

    asked = []
    real = hisparse_pools.host_empty
    monkeypatch.setattr(hisparse_pools, "host_empty", lambda *a, **k: asked.append(k.get("pages")) or real(*a, **k))
    pools_on(None)
    assert asked == ["small"]


def test_an_unknown_host_page_kind_is_refused():
    from hisparse.memory.hisparse_config import HiSparseConfig

    with pytest.raises(ValueError, match="hisparse_config.host_pages must be one of huge, small"):
        HiSparseConfig(host_pages="giant")
