"""Device memory info and stream helpers (CPU fallbacks here; CUDA paths marked gpu), and huge
pages for a host cache."""

from __future__ import annotations

import mmap
import pathlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvferry.adapters.platform import (
    HUGE_PAGE,
    THP_ENABLED,
    MemoryInfo,
    advise_huge_pages,
    as_device,
    default_device,
    host_memory_info,
    huge_page_span,
    memory_info,
    new_stream,
    synchronize,
    thp_mode,
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


def _huge_kb(address: int) -> int:
    """KiB on transparent huge pages in the mapping of this process that holds ``address``."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(" ", 1)[0]
        if "-" in first and ":" not in first:  # a mapping's header line: start-end perms ...
            low, high = (int(x, 16) for x in first.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _private_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A private anonymous mapping of its own (so its huge pages can be read off /proc) and a
    uint8 tensor on it, every byte written."""
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    return buffer, tensor


def test_a_touched_cache_is_moved_onto_huge_pages_with_its_bytes() -> None:
    """A cache already written on 4 KiB pages (an engine allocates and zeroes it at start):
    collapsed, its mapping holds as many bytes on huge pages as the result says, and every byte
    is unchanged. Control: a mapping written the same way and not advised holds none (where the
    kernel uses huge pages only when asked)."""
    mode = thp_mode()
    if not pathlib.Path("/proc/self/smaps").exists() or mode in (None, "never"):
        pytest.skip(f"transparent huge pages are off or unknown here ({THP_ENABLED}: {mode})")
    buffer, flat = _private_buffer(34 << 20)
    control_buffer, control = _private_buffer(34 << 20)
    cache = flat.view(2, -1)
    expected = cache.clone()
    try:
        done = advise_huge_pages([cache[0], cache[1]], collapse=True)
        assert done.total == flat.nbytes  # two views of one storage count once
        span = huge_page_span(flat.data_ptr(), flat.nbytes)
        assert span is not None and done.advised == span[1]
        if "Linux 6.1" in done.reason:
            pytest.skip(f"MADV_COLLAPSE unsupported here: {done.reason}")
        assert done.collapsed == done.advised, done
        assert _huge_kb(span[0]) * 1024 >= done.collapsed
        assert torch.equal(cache, expected)
        assert "MB on huge pages" in done.describe()
        if mode == "madvise":
            assert _huge_kb(control.data_ptr()) == 0
    finally:
        del cache, flat, control, expected
        buffer.close()
        control_buffer.close()


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
