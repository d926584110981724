"""Asynchronous prefetch of the next request's KV (SPEC 7).

One background worker; at most one outstanding prefetch. Starting a new one, or consuming
another request id, drops the stale one (its result, if it arrives, is discarded: the receive
path already released every pool buffer it took). Consuming:

- a RECEIVED result is returned for the caller to apply;
- a miss (timed out, sender unresolved, connector unavailable, not prefetched at all) returns
  None: the caller falls back to a synchronous receive;
- data that was taken from the connector but could not be post-processed (decode failure,
  consumed-but-failed) is reported as such: the data is gone, there is NO synchronous retry.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kvferry.app.receive import ReceiveResult
from kvferry.core.outcomes import ReceiveKind
from kvferry.core.policy import prefetch_allowed
from kvferry.core.roles import ReceiveRole

__all__ = ["Prefetcher", "CONSUMED_KINDS"]

logger = logging.getLogger(__name__)

#: Outcomes after which the payload is gone from the connector: no synchronous retry.
CONSUMED_KINDS = frozenset({ReceiveKind.DECODE_FAILED, ReceiveKind.CONSUMED_BUT_FAILED})


class Prefetcher:
    """``receive(request_id, sender_info, target_device) -> ReceiveResult`` runs on the worker."""

    def __init__(
        self,
        receive: Callable[[str, Any, Any], ReceiveResult],
        *,
        enabled: bool,
        role: Callable[[], ReceiveRole],
        free_ratio: Callable[[], float | None],
        min_free_ratio: float,
        wait_s: float,
    ) -> None:
        self._receive = receive
        self.enabled = enabled
        self._role = role
        self._free_ratio = free_ratio
        self._min_free_ratio = min_free_ratio
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._current: tuple[str, concurrent.futures.Future] | None = None
        self.dropped = 0
        self._closed = False

    @property
    def in_flight(self) -> str | None:
        current = self._current
        return current[0] if current is not None else None

    def start(self, job: Mapping[str, Any], target_device: Any = None) -> tuple[bool, str]:
        """Begin receiving ``job["request_id"]`` in the background; ``(started, reason)``."""
        request_id = str(job.get("request_id") or "") if isinstance(job, Mapping) else ""
        sender_info = job.get("kv_sender_info") if isinstance(job, Mapping) else None
        with self._lock:
            if self._closed:
                return False, "shut_down"
            if not request_id:
                return False, "no_request_id"
            in_flight = self._current is not None and self._current[0] == request_id
            allowed, reason = prefetch_allowed(
                self.enabled, self._role(), sender_info is not None, in_flight, self._free_ratio(), self._min_free_ratio
            )
            if not allowed:
                return False, reason
            self._drop_locked()
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvferry-prefetch")
            future = self._executor.submit(self._receive, request_id, sender_info, target_device)
            self._current = (request_id, future)
            return True, "ok"

    def _drop_locked(self) -> None:
        if self._current is not None:
            rid, future = self._current
            if not future.cancel():
                logger.debug("dropping the stale prefetch of %s", rid)
            self.dropped += 1
            self._current = None

    def take(self, request_id: str) -> ReceiveResult | None:
        """The prefetched result for ``request_id`` (waiting for it), or None when there is none.

        A prefetch of another id is dropped. The caller checks :data:`CONSUMED_KINDS`.
        """
        with self._lock:
            current = self._current
            if current is None:
                return None
            if current[0] != str(request_id):
                self._drop_locked()
                return None
            self._current = None
        rid, future = current
        try:
            return future.result(timeout=self._wait_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            logger.warning("prefetch of %s did not finish in %.1f s", rid, self._wait_s)
            return None
        except concurrent.futures.CancelledError:
            return None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until no prefetch is running (its result stays to be taken); False when one
        is still running after ``timeout_s`` seconds (None: wait as long as it takes)."""
        current = self._current
        if current is None:
            return True
        done, _ = concurrent.futures.wait([current[1]], timeout=timeout_s)
        return bool(done)

    def shutdown(self) -> None:
        """Cancel pending work and stop the worker (idempotent; waits for a running receive)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_locked()
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
