"""``kvferry plan`` run in-process through the real command registry."""

from __future__ import annotations

import json

import pytest

from kvferry.app.cli import main
from kvferry.core.plan import stage_plan, to_json_records

EXAMPLE = [
    "plan",
    "--from-stage",
    "0",
    "--to-stage",
    "1",
    "--from-tp",
    "2",
    "--to-tp",
    "4",
    "--heads",
    "8",
    "--base-port",
    "50051",
    "--request-id",
    "req-7",
]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_example_prints_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, EXAMPLE)
    assert code == 0 and err == ""
    assert "fan-out x2" in out
    for key in ("req-7_0_0_0_0", "req-7_0_0_0_1", "req-7_0_0_1_2", "req-7_0_0_1_3"):
        assert out.count(key) == 2  # put by one sender row, got by one receiver row
    assert "50151" in out and "50167" in out
    sender_rows = out.split("receivers")[0]
    assert "0:4" in sender_rows and "4:8" in sender_rows and "1/2" in sender_rows
    receiver_rows = out.split("receivers")[1].splitlines()[2:]
    assert [row.split()[0] for row in receiver_rows] == ["0", "1", "2", "3"]
    assert receiver_rows[3].split()[:5] == ["3", "6:8", "req-7_0_0_1_3", "1", "50167"]


def test_json_matches_the_core_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, EXAMPLE + ["--json"])
    assert code == 0 and err == ""
    records = json.loads(out)
    assert records == to_json_records(stage_plan(0, 1, 2, 4, num_heads=8, base_port=50051, request_id="req-7"))
    assert [(r["role"], r["tp_rank"]) for r in records] == [
        ("sender", 0),
        ("sender", 1),
        ("receiver", 0),
        ("receiver", 1),
        ("receiver", 2),
        ("receiver", 3),
    ]


def test_defaults_are_the_legacy_single_rank_case(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_OMNI_REPLICA_ID", raising=False)
    code, out, _ = _run(capsys, ["plan", "--json"])
    assert code == 0
    records = json.loads(out)
    assert records[0]["keys"] == [{"key": "omni_0_to_1_kv_cache_req-0", "to_rank": 0, "port": 50151}]
    assert records[1]["keys"][0]["from_rank"] is None


def test_base_port_from_environment(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVF_TEST_BASE_PORT", "6000")
    code, out, _ = _run(capsys, ["plan", "--base-port", "${KVF_TEST_BASE_PORT}", "--json"])
    assert code == 0
    assert json.loads(out)[0]["port"] == 6100


def test_replica_from_environment_and_option(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "1")
    code, out, _ = _run(capsys, ["plan", "--json"])
    assert code == 0 and json.loads(out)[0]["port"] == 51175
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "-3")  # the reference's reading: 0
    code, out, _ = _run(capsys, ["plan", "--json"])
    assert code == 0 and json.loads(out)[0]["port"] == 50151
    code, out, _ = _run(capsys, ["plan", "--replica", "2", "--json"])
    assert code == 0 and json.loads(out)[0]["port"] == 52199


def test_string_stage_and_dp_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys,
        [
            "plan",
            "--to-stage",
            "dit",
            "--from-tp",
            "2",
            "--to-tp",
            "2",
            "--dp-rank",
            "1",
            "--request-id",
            "a_b",
            "--json",
        ],
    )
    assert code == 0
    records = json.loads(out)
    assert records[2]["stage"] == "dit"
    assert records[1]["keys"][0]["key"] == "a_b_0_0_1_1"
    assert records[1]["port"] == 50051 + 100 + (1 * 2 + 1) * 16


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--from-tp", "3", "--to-tp", "2"], "divisible"),
        (["--from-stage", "16"], "from_stage"),
        (["--from-stage", "llm"], "from_stage"),
        (["--from-tp", "0"], "--from-tp"),
        (["--to-tp", "two"], "--to-tp"),
        (["--heads", "6", "--from-tp", "2", "--to-tp", "4"], "num_heads"),
        (["--base-port", "${KVF_SURELY_UNSET_VAR}"], "KVF_SURELY_UNSET_VAR"),
        (["--base-port", "70000"], "--base-port"),
        (["--replica", "-1"], "--replica"),
        (["--dp-rank", "64"], "dp_rank"),
        (["--replica", "20"], "port"),
    ],
)
def test_wrong_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, extra: list[str], needle: str
) -> None:
    monkeypatch.delenv("KVF_SURELY_UNSET_VAR", raising=False)
    code, out, err = _run(capsys, ["plan", *extra])
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvferry plan: error: ")
    assert needle in err and "Traceback" not in err


def test_heads_below_the_tp_sizes_are_planned_with_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    """The case the reference refused: 4 KV heads from TP 2 to TP 8 (each head on 2 receivers)."""
    code, out, err = _run(capsys, ["plan", "--from-tp", "2", "--to-tp", "8", "--heads", "4", "--json"])
    assert code == 0 and err == ""
    records = json.loads(out)
    assert records == to_json_records(
        stage_plan(0, 1, 2, 8, num_heads=4, base_port=50051, replica=0, request_id="req-0")
    )
    receivers = [r for r in records if r["role"] == "receiver"]
    assert [r["heads"] for r in receivers] == [[h, h + 1] for h in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert [r["keys"][0]["from_rank"] for r in receivers] == [0, 0, 0, 0, 1, 1, 1, 1]
    for record in records:  # the --json record fields are kept
        assert {"role", "tp_rank", "heads", "keys"} <= set(record)
        for key in record["keys"]:
            assert {"key", "heads", "to_rank" if record["role"] == "sender" else "from_rank"} <= set(key)
    code, out, _ = _run(capsys, ["plan", "--from-tp", "8", "--to-tp", "2", "--heads", "4"])
    assert code == 0 and "senders replicate each head on 2 ranks" in out
    assert out.count("(none: another replica serves)") == 4  # ranks 1, 3, 5, 7


def test_model_names_give_the_geometry(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, ["plan", "--model", "qwen2.5-7b", "--from-tp", "2", "--to-tp", "8", "--json"])
    assert code == 0
    assert json.loads(out) == to_json_records(
        stage_plan(0, 1, 2, 8, num_heads=4, base_port=50051, replica=0, request_id="req-0")
    )
    code, out, _ = _run(capsys, ["plan", "--model", "deepseek-v2-lite", "--from-tp", "4", "--to-tp", "2"])
    assert code == 0 and "MLA latent of 576" in out and "never sliced" in out
    receiver_rows = out.split("receivers")[1].splitlines()[2:]
    assert [row.split()[3] for row in receiver_rows] == ["0", "2"]  # one sender each, spread
    code, _, err = _run(capsys, ["plan", "--model", "gpt-9"])
    assert code == 2 and "unknown model 'gpt-9'" in err and "deepseek-v3" in err
    code, _, err = _run(capsys, ["plan", "--model", "qwen2.5-7b", "--heads", "4"])
    assert code == 2 and "--model and --heads" in err
    code, _, err = _run(capsys, ["plan", "--from-tp", "2", "--to-tp", "4", "--heads", "6"])
    assert code == 2 and "num_heads 6" in err and "target_tp 4" in err and "source_tp=2" in err
