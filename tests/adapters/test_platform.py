"""Device memory info and stream helpers (CPU fallbacks here; CUDA paths marked gpu)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvferry.adapters.platform import (
    MemoryInfo,
    as_device,
    default_device,
    host_memory_info,
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
