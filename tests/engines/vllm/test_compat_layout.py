"""``OmniKVTransferManager.from_vllm_config`` (vllm-omni's AR runner's path) takes the cache
layout from a real vLLM CPU engine config, and reads the model's own K/V from pages vLLM's own
CPU kernel wrote; the reference's reading of the same pages (FlashAttention's packed layout) is
the control."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from harness import PROC, make_model, vllm_python

pytestmark = [pytest.mark.timeout(600)]


def test_compat_manager_reads_the_models_kv_in_the_engines_layout(tmp_path: Path) -> None:
    py = vllm_python()
    model = make_model(py, tmp_path / "model", 1)
    out = tmp_path / "compat.pt"
    env = {**os.environ, "VLLM_PLUGINS": "none"}
    proc = subprocess.run(
        [py, str(PROC), "compat-kv", str(model), str(out)], capture_output=True, text=True, timeout=500, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = torch.load(out)
    assert r["layout"] == ["vllm_cpu", r["isa"]]  # from vLLM's own choice of kernel, not configured
    assert len(r["truth"]) == 4
    if r["isa"] != "vec":  # vLLM's amx kernel (Intel with AMX): refused by the extraction, never misread
        assert r["got"] is None and r["isa"] in r["refused"]
    else:
        assert r["refused"] is None
        for (k, v), (tk, tv) in zip(r["got"], r["truth"]):
            assert torch.equal(k.contiguous(), tk) and torch.equal(v.contiguous(), tv)
    for (k, _), (tk, _) in zip(r["packed"], r["truth"]):
        assert not torch.equal(k.contiguous(), tk)  # the reference's reading: other K
