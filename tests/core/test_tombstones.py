"""A sender's failure record (core.tombstones) and the lease table's tombstones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.core.errors import ConfigError, FailedAtSender, PayloadError
from kvferry.core.leases import EntryState, LeaseTable
from kvferry.core.tombstones import (
    MAX_KIND_CHARS,
    MAX_REASON_CHARS,
    SenderFailure,
    decode_failure,
    encode_failure,
    failed_error,
    failure_record,
)

kinds = st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@given(kind=kinds, reason=st.text(max_size=2 * MAX_REASON_CHARS))
@settings(max_examples=200, deadline=None)
def test_a_record_round_trips_and_its_reason_is_bounded(kind: str, reason: str) -> None:
    record = failure_record(kind, reason)
    assert record.kind == kind and record.reason == reason[:MAX_REASON_CHARS]
    assert decode_failure(encode_failure(record)) == record
    err = failed_error("k", record, "ipc://x")
    assert isinstance(err, FailedAtSender) and (err.kind, err.reason) == (kind, record.reason)


@given(value=json_values)
@settings(max_examples=300, deadline=None)
def test_anything_else_decodes_to_a_record_or_a_payload_error_only(value: object) -> None:
    try:
        got = decode_failure(value)
    except PayloadError:
        return
    assert isinstance(got, SenderFailure) and decode_failure(encode_failure(got)) == got


@given(value=st.dictionaries(st.sampled_from(["kind", "reason", "x"]), json_values, max_size=3))
@settings(max_examples=300, deadline=None)
def test_a_mutated_record_map_is_refused_unless_it_is_a_record(value: dict) -> None:
    ok = (
        set(value) == {"kind", "reason"}
        and isinstance(value["kind"], str)
        and 0 < len(value["kind"]) <= MAX_KIND_CHARS
        and value["kind"][:1].isalpha()
        and all(c.islower() or c.isdigit() or c == "_" for c in value["kind"])
        and value["kind"].isascii()
        and isinstance(value["reason"], str)
        and len(value["reason"]) <= MAX_REASON_CHARS
    )
    if ok:
        assert decode_failure(value) == SenderFailure(value["kind"], value["reason"])
    else:
        with pytest.raises(PayloadError):
            decode_failure(value)


@pytest.mark.parametrize("kind", ["", "Put", "pool full", "x" * (MAX_KIND_CHARS + 1), "1put", None])
def test_a_sender_names_its_failure_with_a_word(kind: object) -> None:
    with pytest.raises(ConfigError, match="failure kind"):
        failure_record(kind, "why")  # type: ignore[arg-type]


def test_the_lease_table_keeps_a_failure_record_without_an_entry() -> None:
    table = LeaseTable(history=2)
    record = failure_record("put", "the pool stayed full")
    assert table.fail("k", record) and table.status("k") == EntryState.FAILED and table.failure("k") == record
    assert len(table) == 0 and table.take("k", 0.0) is None  # nothing to take: it is no payload
    table.publish("k", "region", 8, now_s=0.0, lease_s=5.0)  # a later payload under the key wins
    assert table.status("k") == EntryState.PUBLISHED and table.failure("k") is None
    assert not table.fail("k", record)  # a readable payload is never shadowed (the pool drops it first)
    assert table.take("k", 1.0) is not None
    assert table.fail("a", record) and table.fail("b", record) and table.fail("c", record)
    assert table.failure("k") is None and table.failure("a") is None  # forgotten beyond history
    assert (table.status("b"), table.status("c")) == (EntryState.FAILED, EntryState.FAILED)
