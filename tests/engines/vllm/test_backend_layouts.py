"""Every attention backend in vLLM's registry is moved bit-exact or refused, never misread
(backend_proc.py walks vLLM's ``AttentionBackendEnum`` in the vLLM venv)."""

from __future__ import annotations

import pytest
from harness import run_json

from kvferry.core.backends import MOVED_BACKENDS

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def walk(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_json("backend_proc.py", tmp_path_factory.mktemp("backends") / "out.json")


def test_the_walk_covers_vllms_registry(walk: dict) -> None:
    # vLLM 0.32 has dozens of backends; every kvferry-moved one is among them
    assert len(walk) > 30 and set(MOVED_BACKENDS) <= set(walk)
    assert {r["status"] for r in walk.values()} == {"moved", "refused"}


def test_moved_backends_read_per_token_what_their_kernel_wrote(walk: dict) -> None:
    moved = {m: r for m, r in walk.items() if r["status"] == "moved"}
    assert set(moved) == set(MOVED_BACKENDS)
    for member, row in moved.items():
        assert row["checks"], member
        for check in row["checks"]:
            assert check.get("ok") is True, (member, check)
            assert check["control_differs"] is True, (member, check)  # the check could fail
    orders = {c["stride_order"] for c in moved["FLASH_ATTN"]["checks"]}
    assert orders == {"LBHNC", "LBNHC"}  # FlashAttention in HND and in NHD


def test_every_other_backend_is_refused_naming_it_and_the_moved_ones(walk: dict) -> None:
    refused = {m: r for m, r in walk.items() if r["status"] == "refused"}
    assert "FLEX_ATTENTION" in refused and "AMX_MLA" in refused and "CUSTOM" in refused
    for member, row in refused.items():
        assert row["name"] in row["reason"], member
        assert all(name in row["reason"] for name in MOVED_BACKENDS), member


def test_a_class_that_calls_itself_flash_attn_is_not_read_as_it(walk: dict) -> None:
    """ROCm's AITER FlashAttention class returns ``FLASH_ATTN`` from ``get_name()``; kvferry
    names backends by the registry member whose class it is, so it is refused (not guessed)."""
    row = walk["ROCM_AITER_FA"]
    assert row["status"] == "refused" and row["name"] in ("ROCM_AITER_FA", "unregistered:FLASH_ATTN")
