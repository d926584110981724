"""The nixl connector between real processes: NIXL agents (UCX over TCP on loopback) in a sender
process and a receiver process, the control channel between them.

The test process drives workers (this file run as a script) through JSON lines on their
stdin/stdout, so every step is synchronised by a message, never by a sleep. The payload is a
real kvferry payload with CRC-32C checksums in its header; the receiver decodes it (verifying
them) and compares every tensor with tensors it builds itself from the same seed, and, as the
control, with those of another seed. Skips, saying why, without the nixl package.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import pytest

if __name__ == "__main__":  # run as a worker: tests/ (jsonlines, nixl_support, process_kit) is not on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import process_kit  # noqa: E402
from jsonlines import commands, say  # noqa: E402
from nixl_support import NIXL_TEST_CONFIG, nixl_missing  # noqa: E402
from process_kit import WAIT_S  # noqa: E402

MiB = 1 << 20
KEY = "req_0_0_0_0"


def tensors(seed: int, layers: int = 4, tokens: int = 512) -> tuple[list[Any], list[Any]]:
    """Key and value tensors (bfloat16, ``tokens`` x 8 heads x 64) drawn from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn((tokens, 8, 64), generator=gen).to(torch.bfloat16)  # noqa: E731
    return [make() for _ in range(layers)], [make() for _ in range(layers)]


def config(role: str, **extra: Any) -> dict[str, Any]:
    return {"type": "nixl", "role": role, "pool_bytes": 64 * MiB, **NIXL_TEST_CONFIG, **extra}


# ----------------------------------------------------------------------------- workers


def sender_main(cfg: dict, seed: int, raw_bytes: int) -> None:
    """Put one kvferry payload of ``seed``'s tensors (checksummed), or ``raw_bytes`` random
    bytes when > 0, report its metadata, then answer ``health`` until ``exit``."""
    import torch

    from kvferry.adapters.connectors.nixl.connector import NixlConnector
    from kvferry.adapters.torch_frames import encode_frames

    with NixlConnector.from_config(cfg) as conn:
        if raw_bytes:
            ok, size, meta = conn.put("0", "1", KEY, torch.randint(0, 256, (raw_bytes,), dtype=torch.uint8))
        else:
            keys, values = tensors(seed)
            payload = encode_frames(KEY, keys, values, [0, 1], {"seed": seed}, checksums="crc32c")
            ok, size, meta = conn.put_frames("0", "1", KEY, payload.frames)
        if not ok:
            say({"error": meta})
            return
        say({"ready": meta, "pid": os.getpid()})
        for command in commands(stop_op=None):
            if command["op"] == "health":
                say({"health": conn.health()})
            else:
                break


def receiver_main(cfg: dict, meta: dict, seed: int) -> None:
    """Get the payload, decode it (checksums verified), compare with ``seed``'s tensors and, as
    the control, with ``seed + 1``'s; then flip one received byte and decode again."""
    import torch

    from kvferry.adapters.connectors.nixl.connector import NixlConnector
    from kvferry.adapters.torch_decode import decode_payload
    from kvferry.core.errors import PayloadError

    def same(decoded: Any, want: tuple[list[Any], list[Any]]) -> bool:
        pairs = list(zip(decoded.key_cache, want[0])) + list(zip(decoded.value_cache, want[1]))
        return all(torch.equal(got.view(torch.int16), ref.view(torch.int16)) for got, ref in pairs)

    with NixlConnector.from_config(cfg) as conn:
        got = conn.get_blocking("0", "1", KEY, meta, timeout_s=60.0)
        if got is None:
            say({"error": conn.last_failure(KEY)})
            return
        buffer, size = got
        decoded = decode_payload(buffer)
        result = {"size": size, "equal": same(decoded, tensors(seed)), "control": same(decoded, tensors(seed + 1))}
        flipped = buffer.tensor.clone()
        flipped[-7] ^= 0x20  # inside the last value tensor
        try:
            decode_payload(flipped)
            result["flip"] = "decoded"
        except PayloadError as exc:
            result["flip"] = str(exc)
        buffer.release()
        say({**result, "health": conn.health()})


@pytest.fixture
def workers():
    yield from process_kit.workers(__file__, nixl_missing())


def _receiver(**extra: Any) -> Any:
    from kvferry.adapters.connectors.nixl.connector import NixlConnector

    return NixlConnector.from_config(config("receiver", **extra))


def _get_in_a_thread(receiver: Any, meta: dict, timeout_s: float) -> tuple[threading.Thread, dict[str, Any]]:
    """``receiver.get_blocking`` of KEY started in a thread; once it ends, the dict holds what
    it returned (``got``) or the kvferry error it raised (``raised``: the blocking get's typed
    exceptions, e.g. SenderUnavailable when the sender's connection drops), and how long it took
    (``elapsed``)."""
    from kvferry.core.errors import KVFerryError

    out: dict[str, Any] = {}

    def get() -> None:
        start = time.monotonic()
        try:
            out["got"] = receiver.get_blocking("0", "1", KEY, meta, timeout_s=timeout_s)
        except KVFerryError as exc:
            out["raised"] = exc
        finally:
            out["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=get)
    thread.start()
    return thread, out


# ----------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_checksummed_payload_moves_bit_exact_between_processes(workers) -> None:
    sender = workers("sender", config("sender", port=0), 7, 0)
    meta = sender.read()["ready"]
    assert meta["size"] > 4 * 2 * 512 * 8 * 64 * 2  # the tensors plus a header
    receiver = workers("receiver", config("receiver"), meta, 7)
    result = receiver.read()
    assert result.get("equal") is True, result
    assert result["control"] is False  # another seed's tensors differ: the comparison looks at the data
    assert "crc32c mismatch" in result["flip"], result["flip"]  # the header's checksums are checked
    assert result["size"] == meta["size"] and result["health"]["hits"] == 1
    assert result["health"]["agent_peers_added"] == 1  # the sender's metadata came over the control channel
    health = sender.health()
    assert health["delivered"] == 1 and health["used_bytes"] == 0  # read once, lease released, freed
    assert health["agent_requests"] == 1


@pytest.mark.slow
def test_sender_killed_while_a_receiver_waits_ends_promptly_as_sender_unavailable(workers) -> None:
    sender = workers("sender", config("sender", port=0), 7, 0)
    endpoint = {k: v for k, v in sender.read()["ready"].items() if k in ("source_host", "source_port")}
    with _receiver() as receiver:
        process_kit.check_sender_killed_while_waiting(sender, receiver, endpoint)


@pytest.mark.slow
def test_frozen_sender_ends_in_a_typed_miss_by_the_deadline_and_frees_the_payload(workers) -> None:
    """A sender that stops answering (SIGSTOP: its sockets stay open, nothing moves, as when the
    link is cut) makes a get end by its deadline with a reason, not hang. Thawed, it serves the
    lookup that was already on its way (at most once: the abandoned claim takes the one reader
    slot, so a retry finds it consumed, unless it overtook the stale lookup) and frees the
    payload when the claim's hold passes: nothing stays pinned."""
    sender = workers("sender", config("sender", port=0, hold_s=2.0, transfer_timeout_s=1.0), 7, 0)
    ready = sender.read()
    meta = ready["ready"]
    with _receiver(control_timeout_s=1.0) as receiver:
        os.kill(ready["pid"], signal.SIGSTOP)
        try:
            start = time.monotonic()
            got = receiver.get_blocking("0", "1", KEY, meta, timeout_s=2.0)
            elapsed = time.monotonic() - start
        finally:
            os.kill(ready["pid"], signal.SIGCONT)
        assert got is None
        assert receiver.last_failure(KEY) in ("timeout", "sender_unavailable")
        assert elapsed < 2.0 + 1.0 + 2.0  # wait + control grace + scheduling slack
        retry = receiver.get_blocking("0", "1", KEY, meta, timeout_s=5.0)
        if retry is None:
            assert receiver.last_failure(KEY) == "not_found"
        else:
            retry[0].release()
        deadline = time.monotonic() + WAIT_S
        while (health := sender.health())["used_bytes"] != 0:
            assert time.monotonic() < deadline, health
        assert health["claims"] >= 1 and health["delivered"] + health["revoked_claims"] >= 1


@pytest.mark.slow
def test_sender_killed_during_a_large_read_ends_by_the_transfer_deadline(workers) -> None:
    """The sender dies once it has handed out the claim (its READ starts at once): the get ends
    within the transfer deadline with a typed reason (a miss with its failure recorded, or
    SenderUnavailable raised when the dropped connection is seen first, as get_blocking
    documents), or, if the READ won the race, with the whole payload. Never a hang, never
    partial bytes handed over."""
    from kvferry.core.errors import SenderUnavailable

    nbytes = 48 * MiB
    sender = workers("sender", config("sender", port=0, pool_bytes=nbytes + MiB), 7, nbytes)
    meta = sender.read()["ready"]
    with _receiver(pool_bytes=nbytes + MiB, transfer_timeout_s=5.0, hold_s=10.0) as receiver:
        thread, out = _get_in_a_thread(receiver, meta, 30.0)
        deadline = time.monotonic() + WAIT_S
        while sender.health()["claims"] != 1:
            assert time.monotonic() < deadline, "the receiver never claimed the payload"
        sender.kill()
        thread.join(30.0)
        assert not thread.is_alive()
        assert out["elapsed"] < 5.0 + 2.0 + 5.0  # transfer deadline + control grace + slack
        if "raised" in out:
            assert isinstance(out["raised"], SenderUnavailable), out["raised"]
            assert receiver.health()["room"] >= nbytes  # nothing of the payload kept
        elif out["got"] is None:
            assert receiver.last_failure(KEY) in ("transfer_failed", "sender_unavailable", "expired")
            assert receiver.health()["room"] >= nbytes  # the failed read gave its pool space back
        else:
            buffer, size = out["got"]
            assert size == nbytes
            buffer.release()


@pytest.mark.slow
def test_sender_frozen_during_a_large_read_ends_the_blocking_get_by_its_deadline(workers) -> None:
    """The sender freezes (SIGSTOP) once it has handed out the claim and its agent metadata, so
    the READ it serves stops moving: the blocking get ends by its deadline plus the control grace with
    ``timeout``, not at the receiver's ``transfer_timeout_s`` (8 s here: the control, what it
    took before the READ was bounded by the get), and gives its pool space back; or, if the
    READ won the race, with the whole payload. Thawed, the sender frees the payload (the failed
    read gave its reader slot back: at the lease's end)."""
    nbytes = 192 * MiB
    sender = workers(
        "sender",
        config("sender", port=0, pool_bytes=nbytes + MiB, hold_s=3.0, lease_s=4.0, transfer_timeout_s=2.0),
        7,
        nbytes,
    )
    ready = sender.read()
    meta = ready["ready"]
    recv_cfg = {"pool_bytes": nbytes + MiB, "control_timeout_s": 1.0, "transfer_timeout_s": 8.0, "hold_s": 10.0}
    with _receiver(**recv_cfg) as receiver:
        thread, out = _get_in_a_thread(receiver, meta, 1.0)
        deadline = time.monotonic() + WAIT_S
        try:
            # the claim is answered, then the sender's agent metadata (one exchange, before the
            # first READ); the READ is posted right after the agent is added
            while receiver.health().get("agent_peers_added", 0) != 1:
                assert time.monotonic() < deadline and thread.is_alive(), "the receiver never reached the READ"
            os.kill(ready["pid"], signal.SIGSTOP)
            thread.join(30.0)
        finally:
            os.kill(ready["pid"], signal.SIGCONT)
        assert not thread.is_alive()
        assert "raised" not in out, out.get("raised")  # a frozen sender's connection stays up
        if out["got"] is None:
            assert receiver.last_failure(KEY) == "timeout"
            # the get's 1 s, the read's control grace 1 s, the unanswered Done 1 s, and slack
            assert out["elapsed"] < 1.0 + 1.0 + 1.0 + 2.0 < recv_cfg["transfer_timeout_s"]
            assert receiver.health()["room"] >= nbytes  # the ended read gave its pool space back
        else:
            buffer, size = out["got"]
            assert size == nbytes
            buffer.release()
        deadline = time.monotonic() + WAIT_S
        while (health := sender.health())["used_bytes"] != 0:
            assert time.monotonic() < deadline, health


if __name__ == "__main__":
    process_kit.worker_main({"sender": sender_main, "receiver": receiver_main})
