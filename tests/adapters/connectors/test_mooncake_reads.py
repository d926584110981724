"""A mooncake pool's reads are bounded: a read the engine has not ended by its limit returns
False then, and the local space it writes into is given back only once the engine has ended it.

The engine here is a stand-in that keeps the binding's contract as kvferry uses it (one batch per
``batch_transfer_async_read``, 0 when it cannot start one; ``transfer_check_status``: 0 running,
1 done, -1 failed, and a batch that answered 1 or -1 is freed: asking about it again is a use
after free, which the stand-in records). It lets a test decide when each batch ends, which a
real engine does not; the real engine's bounded read runs in tests/integration
(test_mooncake_processes.py: a sender frozen mid-read) and tests/hosts (a sender host killed
mid-transfer).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.adapters.connectors.mooncake import engine as engine_module
from kvferry.adapters.connectors.mooncake.engine import EnginePool

POOL = 1 << 20
#: How long a test waits for the late reads' thread to see a batch end (it polls every 5 ms).
WAIT_S = 5.0


class StandInEngine:
    """Batches that end when the test says (or at once, with ``finish`` set)."""

    def __init__(self, finish: int | None = None) -> None:
        self.finish = finish  # the state every new batch starts in (None: running)
        self.lock = threading.Lock()
        self.batches: dict[int, dict[str, Any]] = {}
        self.freed_asked: list[int] = []
        self.unregistered: list[int] = []
        self.refuse = False
        self.submitters: list[str] = []  # the thread of each submission
        self.connect = threading.Event()  # cleared: submissions wait (the peer's handshake hangs)
        self.connect.set()

    def batch_transfer_async_read(self, peer: str, local: list[int], remote: list[int], sizes: list[int]) -> int:
        self.submitters.append(threading.current_thread().name)
        if not self.connect.wait(WAIT_S * 4):  # a peer that never answers the engine's handshake
            return 0
        if self.refuse:
            return 0
        with self.lock:
            batch = len(self.batches) + 1
            self.batches[batch] = {"peer": peer, "local": local, "remote": remote, "sizes": sizes}
            self.batches[batch]["state"] = 0 if self.finish is None else self.finish
            return batch

    def transfer_check_status(self, batch: int) -> int:
        with self.lock:
            entry = self.batches[batch]
            if entry.get("freed"):
                self.freed_asked.append(batch)
            state = int(entry["state"])
            if state in (1, -1):
                entry["freed"] = True
            return state

    def end(self, batch: int, state: int = 1) -> None:
        with self.lock:
            self.batches[batch]["state"] = state

    def unregister_memory(self, base: int) -> int:
        self.unregistered.append(base)
        return 0


def pool(engine: StandInEngine, chunk: int = 4096, timeout_s: float = 10.0) -> EnginePool:
    tensor = torch.zeros(POOL, dtype=torch.uint8)
    return EnginePool(engine, tensor, "127.0.0.1", "tcp", 1, chunk, timeout_s)


class Ended:
    """An ``ended`` hook that counts its calls and can be waited for."""

    def __init__(self) -> None:
        self.calls = 0
        self.event = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.event.set()


def wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, what
        pause.wait(0.002)


spans_st = st.lists(st.tuples(st.integers(0, POOL // 2), st.integers(0, 2**40), st.integers(0, POOL // 4)), max_size=6)


@settings(max_examples=60, deadline=None)
@given(spans_st, st.sampled_from([4096, 5000, 65536, 1 << 20]))
def test_a_read_is_one_batch_per_chunk_and_the_chunks_tile_every_span_in_order(spans, chunk) -> None:
    engine = StandInEngine(finish=1)
    p = pool(engine, chunk)
    ended = Ended()
    assert p.read_spans("peer:1", spans, None, ended) is True
    assert ended.calls == 0  # never called after a read that succeeded
    batches = [engine.batches[b] for b in sorted(engine.batches)]
    assert all(len(b["local"]) == len(b["sizes"]) == 1 and b["peer"] == "peer:1" for b in batches)
    got = [(b["local"][0], b["remote"][0], b["sizes"][0]) for b in batches]
    want = []
    for off, addr, length in spans:
        for at in range(0, length, chunk):
            want.append((p.base + off + at, addr + at, min(chunk, length - at)))
    assert got == want
    assert not engine.freed_asked


def test_a_read_not_done_by_its_limit_returns_then_and_gives_its_space_back_when_it_ends() -> None:
    engine = StandInEngine()
    p = pool(engine)
    ended = Ended()
    start = time.monotonic()
    assert p.read_spans("peer:1", [(0, 1 << 30, 3 * 4096)], 0.2, ended) is False
    took = time.monotonic() - start
    assert 0.2 <= took < 0.2 + 1.0, took  # the caller's limit, not the pool's 10 s
    assert ended.calls == 0 and p.late.in_flight == 1 and p.late.abandoned == 1  # still written into
    engine.end(1)
    engine.end(2)
    assert not ended.event.wait(0.1)  # one chunk still under way: its space is not given back
    engine.end(3, -1)  # a chunk that fails ends too
    assert ended.event.wait(WAIT_S)
    wait_for(lambda: p.late.in_flight == 0, "the late read was not dropped")
    assert ended.calls == 1 and p.late.ended == 1
    assert not engine.freed_asked
    p.close()
    assert engine.unregistered == [p.base]


def test_the_pools_own_deadline_bounds_a_read_without_one() -> None:
    engine = StandInEngine()
    p = pool(engine, timeout_s=0.1)
    start = time.monotonic()
    assert p.read(peer="peer:1", local_offset=0, remote_addr=1 << 30, length=100) is False
    assert time.monotonic() - start < 0.1 + 1.0
    assert p.late.in_flight == 1
    engine.end(1)
    wait_for(lambda: p.late.in_flight == 0, "the late read was not dropped")


def test_a_failed_chunk_ends_the_read_at_once_and_the_rest_are_waited_for() -> None:
    engine = StandInEngine()
    p = pool(engine)
    ended = Ended()
    engine.finish = None
    done = threading.Event()
    result: list[bool] = []

    def read() -> None:
        result.append(p.read_spans("peer:1", [(0, 1 << 30, 2 * 4096)], 5.0, ended))
        done.set()

    thread = threading.Thread(target=read)
    thread.start()
    wait_for(lambda: len(engine.batches) == 2, "the read did not submit both chunks")
    engine.end(1, -1)
    assert done.wait(1.0), "a failed chunk did not end the read"  # not at its 5 s limit
    thread.join(WAIT_S)
    assert result == [False] and ended.calls == 0 and p.late.in_flight == 1
    engine.end(2)
    assert ended.event.wait(WAIT_S) and ended.calls == 1
    assert not engine.freed_asked


def test_a_read_that_fails_at_once_gives_its_space_back_before_it_returns() -> None:
    engine = StandInEngine(finish=-1)
    p = pool(engine)
    ended = Ended()
    assert p.read_spans("peer:1", [(0, 1 << 30, 4096)], None, ended) is False
    assert ended.calls == 1 and p.late.abandoned == 0
    engine.refuse = True  # the engine cannot start a read (an unknown peer)
    assert p.read_spans("peer:1", [(0, 1 << 30, 4096)], None, ended) is False
    assert ended.calls == 2
    # control: the same read succeeds where the engine ends it well
    engine.refuse, engine.finish = False, 1
    assert p.read_spans("peer:1", [(0, 1 << 30, 4096)], None, ended) is True and ended.calls == 2


def test_a_pool_closed_with_a_read_under_way_stays_registered_and_allocated() -> None:
    engine = StandInEngine()
    p = pool(engine, timeout_s=0.05)
    ended = Ended()
    assert p.read_spans("peer:1", [(0, 1 << 30, 4096)], None, ended) is False
    kept = len(engine_module._KEPT)
    p.close()
    assert engine.unregistered == []  # the engine may still write into it
    assert len(engine_module._KEPT) == kept + 1 and engine_module._KEPT[-1] is p.tensor
    assert ended.calls == 0
    engine_module._KEPT.pop()


@pytest.mark.parametrize("reads", [1, 5])
def test_late_reads_of_one_pool_end_each_in_its_own_time(reads) -> None:
    engine = StandInEngine()
    p = pool(engine, timeout_s=0.02)
    hooks = [Ended() for _ in range(reads)]
    for i, hook in enumerate(hooks):
        assert p.read_spans("peer:1", [(i * 4096, 1 << 30, 4096)], None, hook) is False
    assert p.late.in_flight == reads
    for batch in reversed(range(1, reads + 1)):
        engine.end(batch)
        assert hooks[batch - 1].event.wait(WAIT_S)
        assert all(h.calls == (1 if i >= batch - 1 else 0) for i, h in enumerate(hooks))
    wait_for(lambda: p.late.in_flight == 0, "late reads left")
    assert p.late.ended == reads and not engine.freed_asked


def test_a_read_whose_start_hangs_returns_by_its_limit_and_is_polled_once_it_starts() -> None:
    """The engine's first submission to a peer exchanges metadata with it, and waits for a peer
    that does not answer with no limit of its own: the read still returns False by its limit,
    its space kept out of use until the submission returns and the batches it started end. A
    peer reached once is read from without the helper thread; one whose read failed is not."""
    engine = StandInEngine()
    p = pool(engine)
    ended = Ended()
    engine.connect.clear()
    start = time.monotonic()
    assert p.read_spans("peer:1", [(0, 1 << 30, 2 * 4096)], 0.2, ended) is False
    assert time.monotonic() - start < 0.2 + 1.0
    assert ended.calls == 0 and p.late.in_flight == 1 and not engine.batches
    engine.connect.set()  # the handshake completes: both chunks start, still running
    wait_for(lambda: len(engine.batches) == 2, "the submission did not go on")
    assert not ended.event.wait(0.1) and p.late.in_flight == 1
    engine.end(1)
    engine.end(2)
    assert ended.event.wait(WAIT_S) and ended.calls == 1
    wait_for(lambda: p.late.in_flight == 0, "the late read was not dropped")
    assert engine.submitters == ["kvferry-mooncake-submit"] * 2  # the first contact: bounded
    # the peer answered but the read failed: its next start is bounded again
    engine.finish = 1
    assert p.read_spans("peer:1", [(0, 1 << 30, 4096)], 1.0, ended) is True
    assert engine.submitters[-1] == "kvferry-mooncake-submit"
    assert p.read_spans("peer:1", [(0, 1 << 30, 4096)], 1.0, ended) is True  # reached: direct
    assert engine.submitters[-1] == threading.current_thread().name
    engine.finish = -1
    assert p.read_spans("peer:1", [(0, 1 << 30, 4096)], 1.0, ended) is False
    engine.finish = 1
    assert p.read_spans("peer:1", [(0, 1 << 30, 4096)], 1.0, ended) is True
    assert engine.submitters[-1] == "kvferry-mooncake-submit"
    assert not engine.freed_asked
