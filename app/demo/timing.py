"""The demo's timing arithmetic: where each request's time went and where the wall time went.

Pure functions of monotonic-clock stamps (seconds, one clock for every process of the machine):

- a request is *put* when its sender ranks call ``send_requests`` (``put_start``: the last of
  them to start, ``put_end``: the last to return, the payload committed to the transport);
- a receiver rank *waits* for it from the moment it starts its receive, *has* it once the
  receive (with TP consensus) returns, and has *verified* it after comparing every tensor.

:class:`RequestStamps` holds one request's stamps as the ranks reported them;
:func:`request_timing` splits a request into transfer, queueing and verification;
:func:`transfer_figure` is the one transfer figure of the summary: per request, the memcpy of its
bytes over its transfer time (as ``kvferry bench`` defines ``shm_e2e_vs_memcpy``), the median
over requests; :func:`wall_split` splits the run's wall time into start-up, receiving, checking
and shutdown, and, in a paced run (one request at a time, the default), receiving into the
requests' summed transfer times and the pacing between them, so that every part of the wall
time is named and the transfer part is made of the very times the transfer figure is the
median of. When requests overlap (``--overlap``) no rate is made of receiving.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import attrs

__all__ = [
    "RequestStamps",
    "RequestTiming",
    "TransferFigure",
    "WallSplit",
    "request_timing",
    "transfer_figure",
    "wall_split",
    "percentile",
]


@attrs.frozen
class RequestTiming:
    """One request: ``transfer_s`` the time its bytes were being moved (the senders' calls and
    the receivers taking it in), ``queue_s`` the time the committed payload waited for receivers
    still busy with earlier requests, ``check_s`` the slowest receiver rank's verification."""

    transfer_s: float
    queue_s: float
    check_s: float
    #: last receiver rank holding it -> last rank done verifying it (what a paced run's checking
    #: adds to its wall time: ranks that verify while another still receives are in transfer_s)
    tail_s: float = 0.0


@attrs.frozen
class RequestStamps:
    """One request's stamps as its ranks reported them: per sender rank ``put_start`` (the send
    call) and ``put_end`` (its return); per receiver rank, in one rank order, ``waits`` (its
    receive began), ``received`` (it holds the request) and ``verified`` (every tensor
    compared); ``nbytes``: what the senders put, summed."""

    request_id: str
    nbytes: int
    put_start: tuple[float, ...]
    put_end: tuple[float, ...]
    waits: tuple[float, ...]
    received: tuple[float, ...]
    verified: tuple[float, ...]

    @property
    def window(self) -> tuple[float, float]:
        """The first sender rank's send call -> the last receiver rank done verifying."""
        return min(self.put_start), max(self.verified)

    def timing(self) -> RequestTiming:
        """:func:`request_timing` of these stamps."""
        return request_timing(self.put_start, self.put_end, self.waits, self.received, self.verified)


def request_timing(
    put_start: Sequence[float],
    put_end: Sequence[float],
    waits: Sequence[float],
    received: Sequence[float],
    verified: Sequence[float],
) -> RequestTiming:
    """``put_*`` per sender rank; ``waits``, ``received`` and ``verified`` per receiver rank (in
    the same rank order). ``queue = max(0, last wait - last put_end)``; ``transfer = last
    received - last put_start - queue``; ``check = max over ranks of verified - received``.
    ValueError when a list is empty or the receiver lists differ in length."""
    if not (put_start and put_end and waits and received and verified):
        raise ValueError("a request's timing needs at least one sender and one receiver stamp")
    if not len(waits) == len(received) == len(verified):
        raise ValueError("waits, received and verified need one stamp per receiver rank")
    queue = max(0.0, max(waits) - max(put_end))
    transfer = max(0.0, max(received) - max(put_start) - queue)
    check = max(max(0.0, v - r) for r, v in zip(received, verified))
    return RequestTiming(transfer, queue, check, max(0.0, max(verified) - max(received)))


@attrs.frozen
class WallSplit:
    """The wall time (``total_s``, launch -> every worker finished) in four parts that add up to
    it: ``startup_s`` (processes, imports, caches, connections: launch -> every rank ready),
    ``checking_s`` (the receivers verifying, request after request), ``shutdown_s`` (last
    request verified -> every worker finished) and ``receiving_s``, the rest. In a paced run
    ``receiving_s`` is ``transfer_s`` (the requests' transfer times, summed) plus ``pacing_s``
    (letting the next request go), so the wall time is start-up + transfers + checking +
    pacing + shutdown. When requests overlap, several are in flight at once in receiving (so
    bytes over it is no transfer rate: :class:`TransferFigure` is) and ``transfer_s`` is 0."""

    total_s: float
    startup_s: float
    receiving_s: float
    checking_s: float
    shutdown_s: float
    #: Of ``receiving_s``, the requests' summed transfer times when they went one at a time (a
    #: paced run: no two overlap, so they add up); 0.0 for overlapping requests.
    transfer_s: float = 0.0

    @property
    def pacing_s(self) -> float:
        """The rest of ``receiving_s``: the hand-offs between one request and the next."""
        return self.receiving_s - self.transfer_s


def wall_split(
    launch: float,
    ready: float,
    last_verified: float,
    end: float,
    checks: Iterable[float],
    transfers: Iterable[float] = (),
) -> WallSplit:
    """``checks``: each request's ``check_s``; ``transfers``: each request's ``transfer_s`` in a
    paced run (none when requests overlap). Stamps out of order are clamped, so the parts are
    never negative, always add up to ``end - launch``, and the transfers lie within receiving."""
    total = max(0.0, end - launch)
    startup = min(total, max(0.0, ready - launch))
    shutdown = min(total - startup, max(0.0, end - max(last_verified, ready)))
    checking = min(total - startup - shutdown, sum(checks))
    receiving = total - startup - shutdown - checking
    return WallSplit(total, startup, receiving, checking, shutdown, min(receiving, sum(transfers)))


@attrs.frozen
class TransferFigure:
    """The summary's one transfer figure: ``gbps`` the median over requests of a request's bytes
    over its transfer time (GB/s), ``vs_memcpy`` the same median of a request's memcpy time over
    its transfer time (the memcpy of its bytes at ``memcpy_gbps``; larger is faster, 1.0 is a
    transfer as fast as one memcpy). NaN without requests or without a memcpy figure."""

    gbps: float
    vs_memcpy: float
    memcpy_gbps: float


def transfer_figure(request_bytes: Sequence[int], transfer_s: Sequence[float], memcpy_gbps: float) -> TransferFigure:
    """``request_bytes[i]`` moved in ``transfer_s[i]`` seconds; ``memcpy_gbps`` this machine's
    memcpy (GB/s). Requests of zero time or zero bytes are left out. ValueError when the two
    lists differ in length."""
    if len(request_bytes) != len(transfer_s):
        raise ValueError("one transfer time per request")
    rates = [b / t / 1e9 for b, t in zip(request_bytes, transfer_s) if b > 0 and t > 0]
    gbps = statistics.median(rates) if rates else math.nan
    ok = memcpy_gbps > 0 and math.isfinite(gbps)
    return TransferFigure(gbps, gbps / memcpy_gbps if ok else math.nan, memcpy_gbps)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (NaN for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]
