"""A sending stage on one namespace host and a receiving stage on another, driven by the tests.

:class:`TwoHostStage` starts ``from_tp`` sender ranks (``host_worker.py sender``) on host A,
bound to A's address, and ``to_tp`` receiver ranks (one gloo world) on host B. Receivers learn
where the senders are only from the request's sender info (SPEC 2.5), here in its wrapped
form ``{stage_id: {"host", "zmq_port"}}``. Expected tensors are computed in the test process
from its own copy of the senders' synthetic caches (plain indexing, not kvferry's extraction).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
for path in (HERE, HERE.parent / "integration"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from conftest import HostWorker  # noqa: E402
from jsonlines import ChannelSilent  # noqa: E402
from stage_worker import expected_digest, make_spec, sender_caches, spec_to_json  # noqa: E402

#: Seconds past a receive deadline within which every rank must have answered: the receive,
#: then the TP consensus, on a shared 2-core machine. A hang would take the collective's 30 s
#: margin or the worker read deadline, far above this.
SLACK_S = 12.0


class TwoHostStage:
    """Senders on ``a`` (bound to ``bind_host``), receivers on ``b``; ``close()`` ends them."""

    def __init__(
        self,
        forks: Any,
        a: Any,
        b: Any,
        tmp: pathlib.Path,
        *,
        bind_host: str,
        advertise: str | None = None,
        sender_options: dict[str, Any] | None = None,
        receiver_options: dict[str, Any] | None = None,
        **spec_fields: Any,
    ) -> None:
        self.forks, self.a, self.b, self.tmp = forks, a, b, tmp
        self.spec = make_spec(**spec_fields)
        self.caches = sender_caches(self.spec)
        self.bind_host = bind_host
        self.sender_options = {"bind_host": bind_host, **(sender_options or {})}
        self.receiver_options = receiver_options or {}
        self.info = {"0": {"host": advertise or bind_host, "zmq_port": self.spec.advertised_port}}
        self._n = 0
        self.senders: list[HostWorker] = []
        self.receivers: list[HostWorker] = []
        self.ready: list[dict[str, Any]] = []
        try:
            self.start_senders()
            self.start_receivers()
        except BaseException:
            self.kill()
            raise

    # ---------------------------------------------------------------------------- processes
    def _worker(self, host: Any, args: list[Any]) -> HostWorker:
        self._n += 1
        return HostWorker(self.forks, host, args, self.tmp / f"{host.label}-{args[0]}{args[1]}-{self._n}.log")

    def start_senders(self) -> None:
        spec = json.dumps(spec_to_json(self.spec))
        opts = json.dumps(self.sender_options)
        self.senders = [self._worker(self.a, ["sender", r, spec, opts]) for r in range(self.spec.from_tp)]
        self.ready = [w.read() for w in self.senders]
        for rank, ready in enumerate(self.ready):
            assert ready["ready"] == rank and ready["port"] == self.spec.advertised_port + 16 * rank, ready

    def start_receivers(self) -> None:
        spec = json.dumps(spec_to_json(self.spec))
        opts = json.dumps(self.receiver_options)
        store = self.tmp / f"store-{self._n}"
        world = self.spec.to_tp
        self.receivers = [self._worker(self.b, ["receiver", r, world, store, spec, opts]) for r in range(world)]
        for rank, w in enumerate(self.receivers):
            assert w.read()["ready"] == rank

    def kill(self) -> None:
        for w in self.senders + self.receivers:
            w.kill_quietly()

    def close(self) -> None:
        """Ask every worker to exit; each must close its managers and end."""
        last = {w.pid: w.finish() for w in self.senders + self.receivers}
        assert all("closed" in words for words in last.values()), last

    # ------------------------------------------------------------------------------ requests
    def send(self, rid: str, ranks: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
        ranks = tuple(range(self.spec.from_tp)) if ranks is None else ranks
        for r in ranks:
            self.senders[r].send({"op": "send", "rid": rid})
        replies = [self.senders[r].read() for r in ranks]
        for reply in replies:
            assert reply["sent"] == rid and reply["ok"], reply
        return replies

    def start_receive(self, rid: str, timeout_s: float, info: Any = None) -> float:
        info = self.info if info is None else info
        for w in self.receivers:
            w.send({"op": "receive", "rid": rid, "info": info, "timeout": timeout_s})
        return time.monotonic()

    def finish_receive(self, started: float, timeout_s: float) -> list[dict[str, Any]]:
        """Every rank's answer; AssertionError when one is not back by the deadline + slack."""
        replies = []
        for w in self.receivers:
            left = max(0.1, started + timeout_s + SLACK_S - time.monotonic())
            try:
                replies.append(w.read(left))
            except ChannelSilent as exc:  # where every rank waits: the silent one or a peer
                stacks = "\n".join(
                    f"--- worker {x.pid} (receiver {r}):\n{x.stacks()}" for r, x in enumerate(self.receivers)
                )
                raise ChannelSilent(f"{exc}\n{stacks}") from None
        for rank, reply in enumerate(replies):
            assert "error" not in reply, reply
            assert reply["rank"] == rank, reply
        return replies

    def receive(self, rid: str, timeout_s: float, info: Any = None) -> list[dict[str, Any]]:
        return self.finish_receive(self.start_receive(rid, timeout_s, info), timeout_s)

    def expected(self, rid: str, rank: int, caches: Any = None) -> list[str]:
        return expected_digest(self.spec, caches or self.caches, rid, self.spec.head_range(rank))

    def assert_received(self, replies: list[dict[str, Any]], rid: str) -> None:
        for rank, reply in enumerate(replies):
            assert reply["ok"] and reply["outcome"] == "received", reply
            assert reply["digest"] == self.expected(rid, rank), f"{rid} rank {rank} differs"

    def assert_none_received(
        self,
        replies: list[dict[str, Any]],
        timeout_s: float,
        kinds: tuple[str, ...] = ("timed_out", "dropped_by_consensus", "sender_gone"),
    ) -> None:
        """Every rank ended without KV (the group agreed), each in a typed outcome, by the
        deadline (plus slack)."""
        for reply in replies:
            assert not reply["ok"] and reply["digest"] is None, reply
            assert reply["outcome"] in kinds, reply
            assert reply["seconds"] < timeout_s + SLACK_S, reply

    def assert_agreed(self, replies: list[dict[str, Any]], rid: str, bound_s: float) -> bool:
        """Every rank ended alike by ``bound_s`` (plus slack): all with ``rid``'s KV bit-exact,
        or all without it in a typed outcome. True when they received."""
        assert len({r["ok"] for r in replies}) == 1, f"ranks disagree: {replies}"
        if replies[0]["ok"]:
            self.assert_received(replies, rid)
            assert all(r["seconds"] < bound_s + SLACK_S for r in replies), replies
            return True
        self.assert_none_received(replies, bound_s)
        return False

    def sender_health(self) -> list[dict[str, Any]]:
        return [w.ask({"op": "health"})["health"] for w in self.senders]

    def receiver_pools(self) -> list[dict[str, Any]]:
        return [w.ask({"op": "health"})["pools"] for w in self.receivers]
