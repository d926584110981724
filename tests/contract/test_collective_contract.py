"""The collective-group contract (SPEC 6), one suite for every implementation.

The ``runner`` fixture runs a scenario of ``collective_scenarios`` on all ranks of a 4-rank
world: threads over :class:`InProcessWorld`, or 4 gloo processes (spawned once per module,
FileStore rendezvous, loopback only). Every test asserts the same thing for both.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import warm_spawn
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonlines import Channel, ChannelEnded, ChannelSilent

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from collective_scenarios import (  # noqa: E402
    EXPECTED_SAMPLE,
    SHORT_TIMEOUT_S,
    TIMEOUT_SLACK_S,
    WORLD_SIZE,
    Ctx,
    no_pickle,
    run_scenario,
)

from kvferry.adapters.collectives import (  # noqa: E402
    InProcessWorld,
    build_parallel_groups,
    decode_object,
    encode_object,
)
from kvferry.core.errors import ConfigError, PayloadError, RoutingError, TransferTimeout  # noqa: E402
from kvferry.core.roles import GroupLayout  # noqa: E402

SCENARIO_DEADLINE_S = 60.0
STARTUP_DEADLINE_S = 120.0


class InProcessRunner:
    name = "in_process"

    def run(self, scenario: str) -> list[dict[str, Any]]:
        world = InProcessWorld(WORLD_SIZE)
        results: list[Any] = [None] * WORLD_SIZE

        def rank_main(rank: int) -> None:
            ctx = Ctx(rank, WORLD_SIZE, world.group(rank), lambda ranks: world.new_group(ranks, rank))
            results[rank] = run_scenario(scenario, ctx)

        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(WORLD_SIZE)]
        with no_pickle():
            for t in threads:
                t.start()
            for t in threads:
                t.join(SCENARIO_DEADLINE_S)
        assert not any(t.is_alive() for t in threads), f"{scenario} hung"
        return results

    def close(self) -> None:
        pass


class GlooRunner:
    name = "gloo"

    def __init__(self, workdir: pathlib.Path) -> None:
        store = workdir / "store"
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        self.logs = [open(workdir / f"rank{r}.log", "wb") for r in range(WORLD_SIZE)]
        self.procs = [
            warm_spawn.popen(
                [str(HERE / "collective_worker.py"), str(r), str(WORLD_SIZE), str(store)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.logs[r],
                text=True,
                bufsize=1,
                env=env,
            )
            for r in range(WORLD_SIZE)
        ]
        self.channels = [Channel(proc, f"gloo rank {r}") for r, proc in enumerate(self.procs)]
        ready = self._collect(STARTUP_DEADLINE_S, "startup")
        assert [r["ready"] for r in ready] == list(range(WORLD_SIZE))

    def _collect(self, deadline_s: float, what: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + deadline_s
        out: list[Any] = [None] * WORLD_SIZE
        for rank, channel in enumerate(self.channels):
            try:
                out[rank] = channel.read(max(deadline - time.monotonic(), 0.0))
            except ChannelSilent:
                pytest.fail(f"gloo rank {rank} gave no answer to {what} in {deadline_s}s: {self._log(rank)}")
            except ChannelEnded:
                pytest.fail(f"gloo rank {rank} exited during {what}: {self._log(rank)}")
        return out

    def _log(self, rank: int) -> str:
        self.logs[rank].flush()
        return pathlib.Path(self.logs[rank].name).read_text(errors="replace")[-2000:]

    def run(self, scenario: str) -> list[dict[str, Any]]:
        for channel in self.channels:
            channel.send({"scenario": scenario})
        return self._collect(SCENARIO_DEADLINE_S, scenario)

    def close(self) -> None:
        for channel in self.channels:
            try:
                channel.send({"scenario": "exit"})
            except OSError:
                pass
            channel.close_input()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for channel in self.channels:
            channel.close(10)
        for log in self.logs:
            log.close()


@pytest.fixture(scope="module", params=["in_process", "gloo"])
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "in_process":
        r: Any = InProcessRunner()
    else:
        if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
            pytest.skip("torch.distributed with gloo is not available")
        r = GlooRunner(tmp_path_factory.mktemp("gloo"))
    yield r
    r.close()


def oks(results: list[dict[str, Any]]) -> list[Any]:
    for rank, r in enumerate(results):
        assert "ok" in r, f"rank {rank} raised {r}"
    return [r["ok"] for r in results]


def test_broadcast_object(runner: Any) -> None:
    assert oks(runner.run("broadcast_object")) == [EXPECTED_SAMPLE] * WORLD_SIZE


def test_broadcast_none_and_scalars_from_every_source(runner: Any) -> None:
    expected = [None, 0, "", {"dict": [["k", []]]}]
    assert oks(runner.run("broadcast_none_and_scalars")) == [expected] * WORLD_SIZE


def test_broadcast_tensor_fills_in_place(runner: Any) -> None:
    got = oks(runner.run("broadcast_tensor"))
    expected = {"tensor": "torch.int32", "shape": [2, 3], "values": [0.0, 7.0, 14.0, 21.0, 28.0, 35.0]}
    assert got == [{"same_object": True, "value": expected}] * WORLD_SIZE


def test_point_to_point_object(runner: Any) -> None:
    got = oks(runner.run("p2p_object"))
    for rank, value in enumerate(got):
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        assert value == {
            "dict": [
                ["from", peer],
                ["roles", {"tuple": ["a", peer]}],
                ["t", {"tensor": "torch.float32", "shape": [2], "values": [float(peer)] * 2}],
            ]
        }


def test_point_to_point_tensor(runner: Any) -> None:
    got = oks(runner.run("p2p_tensor"))
    dtypes = ["torch.float32", "torch.bfloat16", "torch.int64", "torch.uint8"]
    for rank, per_dtype in enumerate(got):
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        assert per_dtype == [
            {
                "same_object": True,
                "value": {"tensor": d, "shape": [5], "values": [float(i + 10 * peer) for i in range(5)]},
            }
            for d in dtypes
        ]


def test_sub_groups_use_group_local_ranks(runner: Any) -> None:
    got = oks(runner.run("sub_groups"))
    # layout tp=2, cfg=2: TP groups (0,1),(2,3); CFG groups (0,2),(1,3); SP groups of one
    for rank, value in enumerate(got):
        tp_rank, cfg_rank = rank % 2, rank // 2
        assert value["tp"] == [tp_rank, 2] and value["cfg"] == [cfg_rank, 2] and value["sp"] == [0, 1]
        assert value["from_tp1"] == {"tp_src_world_rank": (rank // 2) * 2 + 1}
        assert value["from_cfg"] == (None if cfg_rank == 1 else {"cfg_sender_world_rank": rank + 2})
        assert value["cfg_tensor"] == float(rank % 2)
        assert value["solo"] == "alone"


def _assert_timed_out(result: dict[str, Any]) -> None:
    assert result.get("raised") == "TransferTimeout", result
    assert SHORT_TIMEOUT_S * 0.8 <= result["elapsed"] <= SHORT_TIMEOUT_S + TIMEOUT_SLACK_S, result


def test_peer_that_never_sends_times_out(runner: Any) -> None:
    results = runner.run("recv_from_absent_peer")
    _assert_timed_out(results[1])
    assert [r["ok"] for i, r in enumerate(results) if i != 1] == ["absent"] * (WORLD_SIZE - 1)


def test_broadcast_source_that_never_arrives_times_out(runner: Any) -> None:
    results = runner.run("broadcast_from_absent_source")
    assert results[0]["ok"] == "absent"
    for r in results[1:]:
        _assert_timed_out(r)


def test_broadcast_to_a_peer_that_never_arrives_times_out(runner: Any) -> None:
    results = runner.run("broadcast_to_absent_peer")
    _assert_timed_out(results[0])


def test_unencodable_object_fails_fast_on_every_rank(runner: Any) -> None:
    results = runner.run("source_cannot_encode")
    assert results[0]["raised"] == "ConfigError"
    for r in results[1:]:
        assert r["raised"] == "TransferError" and r["kvferry"], r
        assert r["elapsed"] < TIMEOUT_SLACK_S + 1.0, r
    results = runner.run("sender_cannot_encode")
    assert results[0]["raised"] == "ConfigError"
    assert results[1]["raised"] == "TransferError" and results[1]["elapsed"] < TIMEOUT_SLACK_S + 1.0
    assert [r["ok"] for r in results[2:]] == ["idle"] * (WORLD_SIZE - 2)


def test_world_group_still_works_after_failures_elsewhere(runner: Any) -> None:
    assert oks(runner.run("still_usable_after_failures")) == [EXPECTED_SAMPLE] * WORLD_SIZE


# ---------------------------------------------------------------------------------------------
# the data-only codec and argument checks (no peers needed)

plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(plain)
def test_codec_round_trips_plain_data(value: Any) -> None:
    assert decode_object(encode_object(value)) == value
    # tuples stay tuples, lists stay lists
    assert type(decode_object(encode_object(value))) is type(value)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64))
def test_codec_rejects_garbage_with_payload_error_only(data: bytes) -> None:
    try:
        decode_object(data)
    except PayloadError:
        pass


def test_codec_never_unpickles() -> None:
    with pytest.raises(PayloadError):
        decode_object(pickle.dumps({"a": 1}))
    with pytest.raises(ConfigError, match="data-only"):
        encode_object(object())
    with pytest.raises(ConfigError):
        encode_object({1, 2})


def test_codec_tensors_are_checked() -> None:
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    back = decode_object(encode_object(t))
    assert back.dtype == torch.float16 and torch.equal(back, t)
    nc = torch.arange(6).reshape(2, 3).t()  # non-contiguous
    assert torch.equal(decode_object(encode_object(nc)), nc)
    import msgpack

    bad = [
        ["float32", [2], b"\x00" * 7],  # byte count mismatch
        ["evil", [1], b"\x00"],  # dtype outside the allow-list
        ["float32", [-1], b""],  # negative dim
        ["float32", [1]],  # missing field
    ]
    for fields in bad:
        blob = msgpack.packb(msgpack.ExtType(1, msgpack.packb(fields, use_bin_type=True)), use_bin_type=True)
        with pytest.raises(PayloadError):
            decode_object(blob)
    with pytest.raises(PayloadError, match="extension"):
        decode_object(msgpack.packb(msgpack.ExtType(9, b"")))


def test_in_process_argument_checks() -> None:
    world = InProcessWorld(2)
    g = world.group(0)
    with pytest.raises(RoutingError, match="src"):
        g.broadcast_object(1, 2, timeout_s=1.0)
    with pytest.raises(RoutingError, match="dst"):
        g.send_object(1, -1, timeout_s=1.0)
    with pytest.raises(ConfigError, match="timeout_s"):
        g.recv_object(1, timeout_s=0)
    with pytest.raises(ConfigError, match="size"):
        InProcessWorld(0)
    with pytest.raises(RoutingError):
        world.new_group((0, 0), 0)
    assert world.new_group((1,), 0) is None
    with pytest.raises(TransferTimeout):
        g.recv_tensor(torch.zeros(1), 1, timeout_s=0.05)


def test_build_parallel_groups_checks_world_size() -> None:
    world = InProcessWorld(2)
    with pytest.raises(ConfigError, match="world size"):
        build_parallel_groups(GroupLayout(tp_size=4), 0, world.group(0), lambda r: world.new_group(r, 0))
