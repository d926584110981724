"""The connector's ``register_kv_caches`` reads each layer's layout from vLLM's own backend
classes (connector_layouts_proc.py, in the vLLM venv): what it moves, and what it refuses at
start naming the layer, the backend and what is supported."""

from __future__ import annotations

import pytest
from harness import run_json

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_json("connector_layouts_proc.py", tmp_path_factory.mktemp("connector_layouts") / "out.json")


def test_dense_backends_are_moved_in_the_layout_vllm_chose(cases: dict) -> None:
    assert cases["CPU_ATTN"]["layout"].startswith("vllm_cpu:") and cases["CPU_ATTN"]["layout"].endswith("/LBHNC")
    assert cases["FLASH_ATTN"] == {"layout": "packed/LBHNC", "backend": "FLASH_ATTN"}
    assert cases["TRITON_ATTN"] == {"layout": "packed/LBHNC", "backend": "TRITON_ATTN"}
    # NHD: moved through strided views of its (block, head) pages (pages.PageGeometry nhd)
    assert cases["FLASH_ATTN_nhd"] == {"layout": "packed/LBNHC", "backend": "FLASH_ATTN"}
    assert cases["FLASH_ATTN_fp8"]["layout"] == "packed/LBHNC/fp8_e4m3"  # vLLM's "fp8" is e4m3


def test_mla_backends_are_moved_in_any_stride_order(cases: dict) -> None:
    # one latent "head": HND and NHD are the same bytes
    assert cases["TRITON_MLA"] == {"layout": "mla/LBHNC", "backend": "TRITON_MLA"}
    assert cases["CPU_MLA"] == {"layout": "mla/LBHNC", "backend": "CPU_MLA"}
    assert cases["CPU_MLA_nhd"] == {"layout": "mla/LBNHC", "backend": "CPU_MLA"}


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("AMX_MLA", ["AMX_MLA", "CPU_MLA", "attention_backend"]),  # vLLM's pick on a CPU with AMX
        ("FLEX_ATTENTION", ["FLEX_ATTENTION", "FLASH_ATTN", "CPU_ATTN", "TRITON_MLA"]),
        ("ROCM_AITER_FA", ["ROCM_AITER_FA", "FLASH_ATTN"]),  # its class calls itself FLASH_ATTN
    ],
)
def test_what_the_connector_cannot_move_is_refused_at_start(cases: dict, case: str, says: list[str]) -> None:
    message = cases[case]["refused"]
    assert "model.layers.0.self_attn.attn" in message
    assert all(word in message for word in says), message
