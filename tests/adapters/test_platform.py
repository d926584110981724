"""Device memory info and stream helpers (CPU fallbacks here; CUDA paths marked gpu), and huge
pages for a host cache."""

from __future__ import annotations

import pathlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvferry.adapters.platform import (
    HUGE_PAGE,
    THP_ENABLED,
    MemoryInfo,
    _thp_mode,
    advise_huge_pages,
    as_device,
    default_device,
    host_memory_info,
    huge_page_span,
    memory_info,
    new_stream,
    synchronize,
    use_stream,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_free_ratio() -> None:
    assert MemoryInfo(25, 100).free_ratio == 0.25
    assert MemoryInfo(0, 0, known=False).free_ratio == 1.0
    assert MemoryInfo(200, 100).free_ratio == 1.0


def test_meminfo_parsing(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\n")
    info = host_memory_info(str(f))
    assert (info.free_bytes, info.total_bytes, info.known) == (400 * 1024, 1000 * 1024, True)
    assert info.free_ratio == pytest.approx(0.4)
    f.write_text("MemTotal: 1000 kB\nMemFree: 300 kB\n")  # old kernels: no MemAvailable
    assert host_memory_info(str(f)).free_bytes == 300 * 1024
    f.write_text("garbage\n")
    assert host_memory_info(str(f)) == MemoryInfo(0, 0, "cpu", known=False)
    missing = host_memory_info(str(tmp_path / "absent"))
    assert not missing.known and missing.free_ratio == 1.0


def test_cpu_memory_info_is_sane() -> None:
    info = memory_info("cpu")
    assert 0.0 <= info.free_ratio <= 1.0
    if info.known:
        assert 0 < info.free_bytes <= info.total_bytes


def test_devices() -> None:
    assert as_device("cpu") == torch.device("cpu")
    dev = torch.device("cpu")
    assert as_device(dev) is dev
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert default_device().type == expected and as_device(None).type == expected


def test_cpu_streams_are_no_ops() -> None:
    assert new_stream("cpu") is None
    with use_stream(None) as s:
        assert s is None
        x = torch.ones(3) * 2
    synchronize(None, "cpu")
    assert x.sum().item() == 6.0


@gpu
@pytest.mark.gpu
def test_cuda_memory_and_streams() -> None:
    info = memory_info("cuda")
    assert info.known and 0 < info.free_bytes <= info.total_bytes
    stream = new_stream("cuda")
    assert stream is not None
    with use_stream(stream):
        y = torch.ones(1024, device="cuda") * 3
    synchronize(stream)
    assert y.sum().item() == 3 * 1024


# ------------------------------------------------------------------------- free ports
@pytest.mark.parametrize("from_tp,from_stage", [(1, 0), (4, 0), (2, 3)])
def test_free_base_port_leaves_every_sender_port_bindable(from_tp, from_stage):
    import socket

    from kvferry.adapters.platform import free_base_port
    from kvferry.core.addressing import kv_port

    base = free_base_port(from_tp, from_stage)
    assert base % 16 == 0 and 20000 <= base <= 60000
    probes = []
    try:
        for rank in range(from_tp):  # the ports the library derives for this stage, bound now
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probes.append(probe)
            probe.bind(("127.0.0.1", kv_port(base, from_stage, rank, tp_size=from_tp)))
    finally:
        for probe in probes:
            probe.close()


def test_free_base_port_gives_up_with_a_bind_error():
    from kvferry.adapters.platform import free_base_port
    from kvferry.core.errors import BindError

    with pytest.raises(BindError, match="no base port"):
        free_base_port(1, low=70000, high=70001, attempts=3)  # no OS port is ever in range


# ------------------------------------------------------------------------------------ huge pages
@given(st.integers(0, 1 << 40), st.integers(0, 1 << 30), st.sampled_from([1, 4096, HUGE_PAGE]))
def test_huge_page_span_is_every_whole_aligned_page_inside(address: int, nbytes: int, page: int) -> None:
    span = huge_page_span(address, nbytes, page)
    first = -(-address // page) * page  # the first page boundary at or after the address
    if span is None:
        assert first + page > address + nbytes  # not one whole page fits
        return
    start, length = span
    assert start == first and start % page == 0 and length % page == 0 and length > 0
    assert address <= start and start + length <= address + nbytes
    assert start + length + page > address + nbytes  # no further whole page fits


def _huge_kb() -> int:
    """This process's anonymous memory on transparent huge pages, KiB."""
    for line in pathlib.Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no AnonHugePages in smaps_rollup")


def _collapse_or_skip() -> None:
    if not pathlib.Path("/proc/self/smaps_rollup").exists() or _thp_mode() in (None, "never"):
        pytest.skip(f"transparent huge pages are off or unknown here ({THP_ENABLED}: {_thp_mode()})")


def test_a_touched_cache_is_moved_onto_huge_pages_with_its_bytes() -> None:
    """A cache already written on 4 KiB pages (an engine allocates and zeroes it at start):
    collapsed, the process's huge-page memory grows by what the result says, and every byte is
    unchanged. Control: the same cache without the call stays on small pages."""
    _collapse_or_skip()
    gen = torch.Generator().manual_seed(3)
    cache = torch.randint(0, 256, (2, 64, 256 << 10), dtype=torch.uint8, generator=gen)  # 32 MiB
    expected = cache.clone()
    control = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8, generator=gen)
    before = _huge_kb()
    done = advise_huge_pages([cache[0], cache[1]], collapse=True)
    assert done.total == cache.nbytes  # two views of one storage count once
    assert 0 < done.advised <= cache.nbytes and done.advised % HUGE_PAGE == 0
    if "Linux 6.1" in done.reason:
        pytest.skip(f"MADV_COLLAPSE unsupported here: {done.reason}")
    assert done.collapsed == done.advised, done
    assert _huge_kb() - before >= done.collapsed // 1024
    assert torch.equal(cache, expected)
    assert "MB on huge pages" in done.describe()
    before = _huge_kb()
    control.add_(1)  # written again, never advised: no huge page appears
    assert _huge_kb() == before


def test_huge_pages_say_why_not_rather_than_raise(tmp_path: pathlib.Path) -> None:
    off = tmp_path / "enabled"
    off.write_text("always madvise [never]\n")
    cache = torch.zeros(8 << 20, dtype=torch.uint8)
    done = advise_huge_pages([cache], collapse=True, thp_path=str(off))
    assert (done.total, done.advised, done.collapsed) == (8 << 20, 0, 0)
    assert "off" in done.reason and "never" in done.reason
    assert "unreadable" in advise_huge_pages([cache], thp_path=str(tmp_path / "missing")).reason
    nothing = advise_huge_pages([object(), 3])
    assert nothing.total == 0 and "no host memory" in nothing.reason
