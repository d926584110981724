"""Properties of the pool bookkeeping: allocator geometry, lease/reader semantics, expiry."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError
from kvferry.core.pool import (
    POOL_FULL,
    TOO_LARGE,
    AllocationFailure,
    EntryState,
    ExpiryKind,
    LeaseTable,
    PoolLedger,
    Region,
    RegionAllocator,
    aligned_span,
    request_id_of_key,
)

settings.register_profile("kvferry-pool", max_examples=60, deadline=None)
POOL = settings.get_profile("kvferry-pool")


def check_allocator(alloc: RegionAllocator) -> None:
    """Every structural invariant of the allocator."""
    live = alloc.live_regions()
    holes = alloc.holes()
    spans = sorted([(r.offset, r.end) for r in live] + [(o, o + s) for o, s in holes])
    # live regions and holes tile [0, usable) exactly: no overlap, no gap.
    cursor = 0
    for start, end in spans:
        assert start == cursor, (spans, alloc.usable_bytes)
        assert end > start
        cursor = end
    assert cursor == alloc.usable_bytes or (not spans and alloc.usable_bytes == 0)
    for r in live:
        assert r.offset % alloc.alignment == 0 and r.span % alloc.alignment == 0
        assert r.nbytes <= r.span
    assert alloc.used_bytes == sum(r.span for r in live)
    assert alloc.free_bytes == sum(s for _, s in holes)
    assert alloc.free_bytes + alloc.used_bytes == alloc.usable_bytes
    assert alloc.largest_free == max((s for _, s in holes), default=0)
    # coalescing: no two holes touch.
    for (o1, s1), (o2, _) in zip(holes, holes[1:]):
        assert o1 + s1 < o2


@given(
    capacity=st.integers(1, 1 << 14),
    alignment=st.sampled_from([1, 8, 64, 256]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3000), st.integers(0, 1 << 30)), max_size=60),
)
@settings(max_examples=200, deadline=None)
def test_allocator_random_operations_keep_invariants(capacity, alignment, ops) -> None:
    alloc = RegionAllocator(capacity, alignment)
    live: list[Region] = []
    for is_alloc, nbytes, pick in ops:
        if is_alloc or not live:
            span = aligned_span(nbytes, alignment)
            fits = sorted((size, offset) for offset, size in alloc.holes() if size >= span)
            region = alloc.allocate(nbytes)
            # best fit, read off the holes before the call: the smallest hole that fits, the
            # lowest offset among equals (the allocator keeps its own index of sizes)
            assert (region.offset if region is not None else None) == (fits[0][1] if fits else None)
            if region is None:
                failure = alloc.failure(nbytes)
                expected = TOO_LARGE if aligned_span(nbytes, alignment) > alloc.usable_bytes else POOL_FULL
                assert failure.reason == expected
                if expected == POOL_FULL:
                    # "full now" really means no hole fits.
                    assert alloc.largest_free < aligned_span(nbytes, alignment)
            else:
                assert region.nbytes == nbytes and region.span == aligned_span(nbytes, alignment)
                live.append(region)
        else:
            alloc.free(live.pop(pick % len(live)))
        check_allocator(alloc)
    for region in live:
        alloc.free(region)
    check_allocator(alloc)
    expected_holes = ((0, alloc.usable_bytes),) if alloc.usable_bytes else ()
    assert alloc.holes() == expected_holes


def test_too_large_is_distinguishable_from_full() -> None:
    alloc = RegionAllocator(1000, 64)  # usable 960
    assert alloc.usable_bytes == 960
    assert alloc.too_large(961) and not alloc.too_large(960)
    assert alloc.allocate(961) is None and alloc.failure(961).reason == TOO_LARGE
    first = alloc.allocate(900)
    assert first is not None
    assert alloc.allocate(100) is None
    failure = alloc.failure(100)
    assert isinstance(failure, AllocationFailure) and failure.reason == POOL_FULL
    assert "pool full" in failure.detail and "exceeds" in alloc.failure(5000).detail
    alloc.free(first)
    assert alloc.allocate(100) is not None


def test_best_fit_picks_smallest_hole_and_double_free_is_an_error() -> None:
    alloc = RegionAllocator(64 * 10, 64)
    a, b, c, d = (alloc.allocate(64 * n) for n in (3, 1, 2, 1))
    alloc.free(a)  # hole of 3 units at 0
    alloc.free(c)  # hole of 2 units at 4
    got = alloc.allocate(100)  # 2 units: the 2-unit hole wins over the 3-unit one
    assert got.offset == c.offset
    with pytest.raises(ConfigError):
        alloc.free(a)
    with pytest.raises(ConfigError):
        alloc.allocate(-1)
    with pytest.raises(ConfigError):
        RegionAllocator(100, 48)
    assert b and d


def test_zero_byte_regions_are_distinct() -> None:
    alloc = RegionAllocator(256, 64)
    regions = [alloc.allocate(0) for _ in range(4)]
    assert len({r.offset for r in regions}) == 4 and alloc.allocate(0) is None


# ------------------------------------------------------------------------------ lease table


@given(readers=st.integers(1, 5), extra=st.integers(1, 3), order=st.randoms(use_true_random=False))
@POOL
def test_n_readers_then_not_found_and_freed_after_last_release(readers, extra, order) -> None:
    table = LeaseTable()
    table.publish("k", "H", 10, readers=readers, now_s=0.0, lease_s=5.0)
    tickets = [table.take("k", 1.0) for _ in range(readers)]
    assert all(t is not None and t.handle == "H" and t.size == 10 for t in tickets)
    assert len({t.ticket_id for t in tickets}) == readers
    for _ in range(extra):
        assert table.take("k", 1.0) is None  # late/duplicate reader: not found
    assert table.status("k") == EntryState.DRAINED
    order.shuffle(tickets)
    for index, ticket in enumerate(tickets):
        freed = table.release(ticket.ticket_id)
        assert (freed is not None) == (index == readers - 1)
        assert table.release(ticket.ticket_id) is None  # idempotent
    assert len(table) == 0 and table.entries() == ()


def test_unread_payload_expires_and_is_reported_once() -> None:
    table = LeaseTable()
    table.publish("a", 1, 1, now_s=0.0, lease_s=2.0)
    table.publish("b", 2, 1, now_s=1.0, lease_s=2.0)
    assert table.next_deadline() == 2.0
    assert table.expire(1.9) == ()
    report = table.expire(2.0)
    assert [(x.entry.key, x.kind, x.freed) for x in report] == [("a", "unread", True)]
    assert table.take("a", 2.0) is None and table.status("a") == EntryState.EXPIRED
    assert table.status("never") == "unknown"  # expired is distinguishable from never existed
    assert table.take("b", 2.5) is not None
    assert table.expire(2.0) == ()


def test_take_past_deadline_is_not_found_even_before_expire() -> None:
    table = LeaseTable()
    table.publish("a", 1, 1, now_s=0.0, lease_s=1.0)
    assert table.take("a", 1.0) is None


def test_unreleased_ticket_is_revoked_after_hold() -> None:
    table = LeaseTable(hold_s=3.0)
    table.publish("a", "R", 1, readers=2, now_s=0.0, lease_s=10.0)
    t1 = table.take("a", 1.0)
    t2 = table.take("a", 2.0)
    assert table.release(t2.ticket_id) is None  # t1 still out
    report = table.expire(4.0)
    assert [(x.kind, x.freed) for x in report] == [("unreleased", True)]
    assert table.release(t1.ticket_id) is None  # revoked: a late release is a no-op
    assert len(table) == 0


def test_late_release_never_touches_a_newer_payload_under_the_same_key() -> None:
    table = LeaseTable(hold_s=1.0)
    table.publish("k", "old", 1, now_s=0.0, lease_s=5.0)
    old = table.take("k", 0.5)
    table.expire(2.0)  # revokes the old ticket
    table.publish("k", "new", 1, now_s=2.0, lease_s=5.0)
    assert table.release(old.ticket_id) is None
    new = table.take("k", 2.5)
    assert new.handle == "new" and new.entry_id != old.entry_id


def test_publish_validation_and_duplicates() -> None:
    table = LeaseTable()
    table.publish("k", 0, 1, now_s=0.0, lease_s=1.0)
    with pytest.raises(ConfigError, match="already published"):
        table.publish("k", 0, 1, now_s=0.0, lease_s=1.0)
    for bad in ({"readers": 0}, {"lease_s": 0}, {"lease_s": float("nan")}):
        kwargs = {"readers": 1, "now_s": 0.0, "lease_s": 1.0} | bad
        with pytest.raises(ConfigError):
            table.publish("x", 0, 1, **kwargs)


def test_drop_request_uses_key_formats() -> None:
    table = LeaseTable()
    keys = ["req_1_0_0_0", "req_1_0_1_0", "omni_0_to_1_kv_cache_req", "other_1_0_0_0"]
    for key in keys:
        table.publish(key, key, 1, now_s=0.0, lease_s=9.0)
    held = table.take("req_1_0_1_0", 0.0)
    freed = table.drop_request("req")
    assert sorted(e.key for e in freed) == ["omni_0_to_1_kv_cache_req", "req_1_0_0_0"]
    assert table.take("req_1_0_0_0", 0.0) is None and table.status("req_1_0_0_0") == "dropped"
    assert table.take("other_1_0_0_0", 0.0) is not None
    assert table.release(held.ticket_id) is not None  # drained entry freed at its release
    assert request_id_of_key("a_b_c") == "a_b_c"
    assert request_id_of_key("my_req_7_3_0_1_2") == "my_req_7"


# ------------------------------------------------------------------------------- ledger


ledger_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 3), st.integers(0, 700), st.integers(1, 3)),
        st.tuples(st.just("take"), st.integers(0, 3)),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("give_back"), st.integers(0, 50)),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
        st.tuples(st.just("drop"), st.integers(0, 3)),
    ),
    max_size=80,
)


@given(ops=ledger_ops)
@POOL
def test_ledger_regions_follow_entries(ops) -> None:
    """Regions are freed exactly when their entry is gone; readers never see another payload."""
    ledger = PoolLedger.create(4096, alignment=64, hold_s=4.0)
    freed: list[int] = []  # on_free: each entry once, after its region went back
    ledger.on_free = lambda e: freed.append(e.entry_id) or check_free(e)

    def check_free(entry) -> None:
        assert entry.handle not in ledger.allocator.live_regions()
        assert entry.entry_id not in {e.entry_id for e in ledger.leases.entries()}

    published: set[int] = set()
    now = 0.0
    contents: dict[int, str] = {}  # region offset -> key written there (the "bytes")
    tickets = []
    for op in ops:
        if op[0] == "put":
            key = f"r{op[1]}_0_0_0_0"
            region = ledger.reserve(op[2])
            if isinstance(region, AllocationFailure):
                assert region.reason in (POOL_FULL, TOO_LARGE)
                continue
            assert region.offset not in contents  # never hand out a region still in use
            contents[region.offset] = key
            published.add(ledger.publish(key, region, readers=op[3], now_s=now, lease_s=2.0).entry_id)
        elif op[0] == "take":
            ticket = ledger.take(f"r{op[1]}_0_0_0_0", now)
            if ticket is not None:
                assert contents[ticket.handle.offset] == ticket.key
                tickets.append(ticket)
        elif op[0] == "release" and tickets:
            ledger.release(tickets[op[1] % len(tickets)].ticket_id)
        elif op[0] == "give_back" and tickets:  # a failed read: the reader may try again
            ticket = tickets[op[1] % len(tickets)]
            before = ledger.leases.entry(ticket.key)
            ledger.give_back(ticket.ticket_id, now)
            after = ledger.leases.entry(ticket.key)
            if after is not None and before is not None and after.entry_id == before.entry_id:
                assert after.readers_left <= after.readers
        elif op[0] == "tick":
            now += op[1]
            ledger.expire(now)
        elif op[0] == "drop":
            ledger.drop_request(f"r{op[1]}")
        live = {r.offset for r in ledger.allocator.live_regions()}
        held = {e.handle.offset for e in ledger.leases.entries()}
        assert live == held  # nothing reserved-but-unpublished in this test
        # unread (the gauge a prefill reports): entries some reader may still take, never more
        # than those held; a taken entry whose ticket is out is held, not unread
        stats = ledger.stats()
        published_now = [e for e in ledger.leases.entries() if e.state == EntryState.PUBLISHED]
        assert stats["readable"] == len(published_now) <= stats["entries"]
        # freed entries told once each; every published entry is held or told
        held_ids = {e.entry_id for e in ledger.leases.entries()}
        assert len(freed) == len(set(freed)) and not held_ids & set(freed)
        assert held_ids | set(freed) == published
        for offset in list(contents):
            if offset not in live:
                del contents[offset]
        check_allocator(ledger.allocator)
    ledger.expire(now + 100.0)
    assert ledger.allocator.used_bytes == 0 and len(ledger.leases) == 0
    assert sorted(freed) == sorted(published)


def test_ledger_reserve_abort_publish() -> None:
    ledger = PoolLedger.create(256)
    region = ledger.reserve(100)
    assert ledger.stats()["reserved"] == 1
    ledger.abort(region)
    ledger.abort(region)  # idempotent
    assert ledger.stats()["used_bytes"] == 0
    with pytest.raises(ConfigError):
        ledger.publish("k", region, now_s=0.0, lease_s=1.0)
    first = ledger.reserve(64)
    ledger.publish("k", first, now_s=0.0, lease_s=1.0)
    second = ledger.reserve(64)
    ledger.publish("k", second, now_s=0.0, lease_s=1.0)  # latest put wins; the old one is freed
    assert ledger.stats()["live_regions"] == 1
    ticket = ledger.take("k", 0.5)
    assert ticket.handle == second and ledger.release(ticket.ticket_id)
    assert ledger.stats() | {} == {
        "pool_bytes": 256,
        "used_bytes": 0,
        "free_bytes": 256,
        "largest_free": 256,
        "live_regions": 0,
        "reserved": 0,
        "entries": 0,
        "readable": 0,
        "overdue": 0,
    }


def test_ledger_fail_drops_the_payload_and_records_the_failure() -> None:
    ledger = PoolLedger.create(256)
    ledger.publish("k", ledger.reserve(64), now_s=0.0, lease_s=10.0)
    held = ledger.reserve(64)
    ledger.publish("h", held, now_s=0.0, lease_s=10.0)
    ticket = ledger.take("h", 0.1)  # a reader holds "h"
    freed, recorded = ledger.fail("k", "why")
    assert recorded and len(freed) == 1 and ledger.leases.status("k") == EntryState.FAILED
    assert ledger.leases.failure("k") == "why" and ledger.take("k", 0.2) is None
    freed, recorded = ledger.fail("h", "why")  # the held region stays until its reader releases
    assert recorded and freed == () and ledger.stats()["live_regions"] == 1
    assert ticket is not None and ledger.release(ticket.ticket_id)
    assert ledger.stats()["used_bytes"] == 0
    _, again = ledger.fail("never-put", "why")  # a key never published takes a record too
    assert again and ledger.stats()["entries"] == 0


# ------------------------------------------------------------------------ holders and holds


def test_a_live_holder_is_never_revoked_only_reported_once() -> None:
    table = LeaseTable(hold_s=1.0)
    table.publish("k", "R", 8, now_s=0.0, lease_s=10.0)
    ticket = table.take("k", 0.0, holder="pid-7")
    assert ticket.holder == "pid-7"
    alive = {"pid-7"}
    report = table.expire(5.0, alive.__contains__)
    assert [(x.kind, x.freed, x.holders) for x in report] == [(ExpiryKind.OVERDUE, False, ("pid-7",))]
    assert table.expire(50.0, alive.__contains__) == ()  # reported once, still held
    assert table.overdue_count() == 1 and len(table) == 1
    assert table.next_deadline() is None  # nothing to wait for: the holder is asked each time
    alive.clear()  # the reader died
    report = table.expire(51.0, alive.__contains__)
    assert [(x.kind, x.freed, x.holders) for x in report] == [(ExpiryKind.UNRELEASED, True, ("pid-7",))]
    assert len(table) == 0 and table.overdue_count() == 0


def test_each_holder_is_asked_once_per_expiry_pass() -> None:
    table = LeaseTable(hold_s=1.0)
    for i in range(5):
        table.publish(f"k{i}", i, 1, now_s=0.0, lease_s=10.0)
        table.take(f"k{i}", 0.0, holder="reader")
    asked: list[str] = []
    table.expire(2.0, lambda holder: asked.append(holder) or True)
    table.expire(3.0, lambda holder: asked.append(holder) or True)
    assert asked == ["reader", "reader"] and table.overdue_count() == 5


def test_without_a_liveness_test_or_holder_an_overdue_ticket_is_revoked() -> None:
    table = LeaseTable(hold_s=1.0)
    table.publish("a", "A", 1, readers=2, now_s=0.0, lease_s=10.0)
    table.take("a", 0.0, holder="someone")
    table.take("a", 0.0)  # no holder
    report = table.expire(2.0, lambda holder: True)
    assert [(x.kind, x.freed, x.holders) for x in report] == [
        (ExpiryKind.UNRELEASED, False, (None,)),
        (ExpiryKind.OVERDUE, False, ("someone",)),
    ]
    assert [(x.kind, x.freed) for x in table.expire(3.0)] == [(ExpiryKind.UNRELEASED, True)]


holder_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 3), st.integers(0, 700)),
        st.tuples(st.just("take"), st.integers(0, 3), st.sampled_from([None, "p1", "p2"])),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
        st.tuples(st.just("kill"), st.sampled_from(["p1", "p2"])),
    ),
    max_size=80,
)


@given(ops=holder_ops)
@POOL
def test_bytes_a_live_holder_reads_are_never_reused(ops) -> None:
    """While a holder lives and keeps its ticket, its region is never handed out again, however
    long it holds; once it is gone, an expire past hold_s gives the region back."""
    ledger = PoolLedger.create(4096, alignment=64, hold_s=1.0)
    alive = {"p1", "p2"}
    now = 0.0
    held: dict[int, tuple[str, Region]] = {}  # ticket id -> (holder, region) while unreleased
    tickets = []
    for op in ops:
        if op[0] == "put":
            region = ledger.reserve(op[2])
            if isinstance(region, AllocationFailure):
                continue
            for holder, live in held.values():
                if holder in alive:  # never hand out bytes a live reader still maps
                    assert region.offset >= live.end or region.end <= live.offset
            ledger.publish(f"r{op[1]}_0_0_0_0", region, now_s=now, lease_s=2.0)
        elif op[0] == "take":
            ticket = ledger.take(f"r{op[1]}_0_0_0_0", now, holder=op[2])
            if ticket is not None:
                tickets.append(ticket)
                held[ticket.ticket_id] = (op[2], ticket.handle)
        elif op[0] == "release" and tickets:
            ticket = tickets[op[1] % len(tickets)]
            ledger.release(ticket.ticket_id)
            held.pop(ticket.ticket_id, None)
        elif op[0] == "tick":
            now += op[1]
            for x in ledger.expire(now, alive.__contains__):
                assert not any(h in alive for h in x.holders) or x.kind == ExpiryKind.OVERDUE
        elif op[0] == "kill":
            alive.discard(op[1])
        live_offsets = {r.offset for r in ledger.allocator.live_regions()}
        for holder, region in held.values():
            if holder in alive:
                assert region.offset in live_offsets
        check_allocator(ledger.allocator)
    alive.clear()
    ledger.expire(now + 100.0, alive.__contains__)
    assert ledger.allocator.used_bytes == 0 and len(ledger.leases) == 0


# ------------------------------------------------------------------------- failed reads
def test_a_failed_read_gives_its_reader_slot_back_while_the_lease_lasts() -> None:
    ledger = PoolLedger.create(1024, alignment=64)
    region = ledger.reserve(100)
    ledger.publish("r_0_0_0_0", region, readers=1, now_s=0.0, lease_s=5.0)
    first = ledger.take("r_0_0_0_0", 1.0)
    assert first is not None and ledger.take("r_0_0_0_0", 1.0) is None  # drained
    assert ledger.give_back(first.ticket_id, 1.5) is None  # relisted, not freed
    assert ledger.give_back(first.ticket_id, 1.5) is None  # idempotent
    again = ledger.take("r_0_0_0_0", 2.0)
    assert again is not None and again.handle == region and again.ticket_id != first.ticket_id
    assert ledger.release(again.ticket_id) is not None and ledger.allocator.used_bytes == 0


def test_a_failed_read_after_the_lease_or_a_newer_put_frees_like_a_release() -> None:
    ledger = PoolLedger.create(1024, alignment=64)
    old = ledger.reserve(100)
    ledger.publish("r_0_0_0_0", old, readers=1, now_s=0.0, lease_s=5.0)
    late = ledger.take("r_0_0_0_0", 1.0)
    assert ledger.give_back(late.ticket_id, 6.0) is not None  # lease passed: freed, not relisted
    assert ledger.take("r_0_0_0_0", 6.0) is None and ledger.allocator.used_bytes == 0

    first = ledger.reserve(100)
    ledger.publish("r_0_0_0_0", first, readers=1, now_s=10.0, lease_s=5.0)
    stale = ledger.take("r_0_0_0_0", 10.0)
    newer = ledger.reserve(100)
    ledger.publish("r_0_0_0_0", newer, readers=1, now_s=11.0, lease_s=5.0)  # the key moved on
    assert ledger.give_back(stale.ticket_id, 11.0) is not None  # the old payload is freed
    current = ledger.take("r_0_0_0_0", 11.0)
    assert current is not None and current.handle == newer


@given(readers=st.integers(1, 4), failures=st.integers(0, 6))
def test_failed_reads_never_cost_a_reader_its_turn(readers: int, failures: int) -> None:
    """Any number of failed reads, then ``readers`` successful ones: exactly those many takes
    succeed, and the region is freed after the last release."""
    ledger = PoolLedger.create(1024, alignment=64)
    region = ledger.reserve(64)
    ledger.publish("r_0_0_0_0", region, readers=readers, now_s=0.0, lease_s=100.0)
    for i in range(failures):
        ticket = ledger.take("r_0_0_0_0", float(i))
        assert ticket is not None
        ledger.give_back(ticket.ticket_id, float(i))
    good = [ledger.take("r_0_0_0_0", 50.0) for _ in range(readers)]
    assert all(t is not None for t in good) and ledger.take("r_0_0_0_0", 50.0) is None
    for ticket in good:
        ledger.release(ticket.ticket_id)
    assert ledger.allocator.used_bytes == 0 and len(ledger.leases) == 0


# ------------------------------------------------------------- expiry visits only what is due
class ScanEveryEntry(LeaseTable):
    """The oracle: expiry looks at every held entry, the next deadline is the least over all of
    them, a request's keys are found by looking at every key (what the table did before it kept
    a heap of deadlines and an index by request)."""

    def drop_request(self, request_id: str) -> tuple:
        return self._drop([r for r in self._by_key.values() if r.request_id == request_id])

    def _due(self, now_s: float) -> list:
        return list(self._held.values())

    def next_deadline(self) -> float | None:
        times = []
        for record in self._held.values():
            if record.state == EntryState.PUBLISHED:
                times.append(record.created_s + record.lease_s)
            times.extend(h.taken_s + self._hold_of(record) for h in record.tickets.values() if not h.overdue)
        return min(times, default=None)


expiry_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 5), st.integers(1, 3), st.sampled_from([0.5, 2.0, 5.0])),
        st.tuples(st.just("put_rank"), st.integers(0, 5), st.integers(0, 2)),
        st.tuples(st.just("take"), st.integers(0, 5), st.sampled_from([None, "p1", "p2"])),
        st.tuples(st.just("release"), st.integers(0, 60)),
        st.tuples(st.just("give_back"), st.integers(0, 60)),
        st.tuples(st.just("drop"), st.integers(0, 5)),
        st.tuples(st.just("tick"), st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.5]), st.booleans()),
        st.tuples(st.just("kill"), st.sampled_from(["p1", "p2"])),
    ),
    max_size=120,
)


@given(ops=expiry_ops, hold_s=st.sampled_from([None, 0.5, 1.0, 3.0]))
@example(  # a read fails after the drained entry's lease deadline was dropped as stale
    ops=[("put", 0, 1, 2.0), ("take", 0, None), ("give_back", 0), ("tick", 2.0, False)], hold_s=3.0
)
@example(  # a live holder's ticket goes overdue, then its holder dies
    ops=[("put", 0, 1, 5.0), ("take", 0, "p1"), ("tick", 1.0, True), ("kill", "p1"), ("tick", 0.25, True)],
    hold_s=0.5,
)
@settings(max_examples=200, deadline=None)
def test_expiry_reports_what_a_scan_of_every_entry_reports(ops, hold_s) -> None:
    """Same operations, same clock: the table that visits only due entries reports exactly
    what a scan of every entry reports (kinds, freed, holders, order), and gives the same next
    deadline, after every operation. Deadlines fall on the same instants on purpose (ties)."""
    fast, full = LeaseTable(hold_s=hold_s), ScanEveryEntry(hold_s=hold_s)
    alive = {"p1", "p2"}
    now = 0.0
    tickets: list[int] = []

    def view(report) -> list:
        return [(x.entry.entry_id, x.entry.state, x.kind, x.freed, x.holders) for x in report]

    for op in ops:
        if op[0] == "put":
            key = f"r{op[1]}_0_0_0_0"
            for table in (fast, full):
                table.drop_key(key)
                table.publish(key, key, 8, readers=op[2], now_s=now, lease_s=op[3])
        elif op[0] == "put_rank":  # another key of the same request (another rank's payload)
            key = f"r{op[1]}_0_0_{op[2]}_1"
            for table in (fast, full):
                table.drop_key(key)
                table.publish(key, key, 8, now_s=now, lease_s=2.0)
        elif op[0] == "take":
            got = [t.take(f"r{op[1]}_0_0_0_0", now, holder=op[2]) for t in (fast, full)]
            assert (got[0] is None) == (got[1] is None)
            if got[0] is not None:
                assert got[0].ticket_id == got[1].ticket_id
                tickets.append(got[0].ticket_id)
        elif op[0] in ("release", "give_back") and tickets:
            ticket = tickets[op[1] % len(tickets)]
            if op[0] == "release":
                freed = [t.release(ticket) for t in (fast, full)]
            else:
                freed = [t.give_back(ticket, now) for t in (fast, full)]
            assert freed[0] == freed[1]
        elif op[0] == "drop":
            assert fast.drop_request(f"r{op[1]}") == full.drop_request(f"r{op[1]}")
        elif op[0] == "tick":
            now += op[1]
            liveness = alive.__contains__ if op[2] else None
            assert view(fast.expire(now, liveness)) == view(full.expire(now, liveness))
        elif op[0] == "kill":
            alive.discard(op[1])
        assert fast.next_deadline() == full.next_deadline()
        assert fast.overdue_count() == full.overdue_count()
        assert fast.entries() == full.entries()
    alive.clear()
    assert view(fast.expire(now + 100.0, alive.__contains__)) == view(full.expire(now + 100.0, alive.__contains__))
    assert len(fast) == len(full) == 0 and fast.next_deadline() is None


def test_expiry_with_many_waiting_payloads_visits_only_the_due_ones() -> None:
    """10 000 payloads waiting for their readers: an expire that nothing is due for looks at no
    entry (the scan oracle looks at all of them), one that a single lease ran out for looks at
    that one, and the rest stay readable."""
    table = LeaseTable(hold_s=5.0)
    table.publish("early", "E", 8, now_s=0.0, lease_s=1.0)
    for i in range(10_000):
        table.publish(f"k{i}", i, 8, now_s=0.0, lease_s=30.0)
    assert table._due(0.5) == [] and len(ScanEveryEntry()._due(0.5)) == 0
    oracle = ScanEveryEntry()
    oracle.publish("k", 0, 8, now_s=0.0, lease_s=30.0)
    assert table._due(0.5) == [] and len(oracle._due(0.5)) == 1  # the scan looks at every entry
    report = table.expire(1.0)
    assert [(x.entry.key, x.kind) for x in report] == [("early", ExpiryKind.UNREAD)]
    assert len(table.readable_keys()) == 10_000 and table.next_deadline() == 30.0


def test_deadlines_of_payloads_read_and_released_do_not_pile_up() -> None:
    """A busy sender: 5 000 payloads published, read and released long before their leases end.
    The deadlines kept stay within a bound of what is held (stale ones are dropped), and a
    payload left unread still expires on time."""
    table = LeaseTable(hold_s=60.0)
    table.publish("unread", "U", 8, now_s=0.0, lease_s=120.0)
    for i in range(5_000):
        table.publish(f"k{i}", i, 8, now_s=i * 0.001, lease_s=120.0)
        table.release(table.take(f"k{i}", i * 0.001).ticket_id)
        assert len(table._deadlines) <= 64 + 2 * (len(table) + 1) + 1
    assert len(table) == 1 and table.next_deadline() == 120.0
    assert [(x.entry.key, x.kind, x.freed) for x in table.expire(120.0)] == [("unread", ExpiryKind.UNREAD, True)]
    assert table.next_deadline() is None


def test_the_hold_cannot_change_under_tickets_already_taken() -> None:
    table = LeaseTable(hold_s=1.0)
    with pytest.raises(attrs.exceptions.FrozenAttributeError):
        table.hold_s = 5.0
