"""Connector and transfer-manager commands of a benchmark peer (see :mod:`.worker`).

Both sides of a kvferry path: ``kv_*`` drive the library's primitives directly (extraction
gathered into the connector, views decoded on the receiver), ``mgr_*`` go through
:class:`~kvferry.app.manager.KVTransferManager` as an engine would. Faults and memory helpers
used by every command live here too.
"""

from __future__ import annotations

import re
import resource
import threading
import time
from typing import Any

__all__ = ["KvCommands", "GetWaits", "cpu_s", "faults", "memory_kb", "reset_peak_rss", "stamped", "watched"]

#: How long a receive command waits for its ranks to ask for their payloads before it
#: announces anyway (a connector whose receive never calls one of :data:`PAYLOAD_GETS`; reported).
ANNOUNCE_WAIT_S = 5.0


def cpu_s() -> float:
    """CPU seconds (user + system) of this whole process so far, every thread counted: what a
    path costs the machine, which a busy machine's other work does not inflate as it does
    wall time."""
    return time.process_time()


def faults() -> int:
    """Minor + major page faults of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def memory_kb() -> dict[str, int]:
    """``rss_kb`` (VmRSS), ``hwm_kb`` (VmHWM, the peak since the last reset) and ``maxrss_kb``."""
    out = {"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    try:
        with open("/proc/self/status") as status:
            text = status.read()
    except OSError:
        return {**out, "rss_kb": -1, "hwm_kb": out["maxrss_kb"]}
    for field, key in (("VmRSS", "rss_kb"), ("VmHWM", "hwm_kb")):
        match = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
        out[key] = int(match.group(1)) if match else -1
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False when unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _names(key: str, request_id: str) -> bool:
    """Whether a connector key belongs to ``request_id`` (``..._{rid}`` or ``{rid}_...``)."""
    return key.endswith("_" + request_id) or key.startswith(request_id + "_")


class _StampedReservation:
    """A reservation whose commit (the moment the payload is put) is stamped."""

    def __init__(self, inner: Any, key: str, stamps: list) -> None:
        self._inner, self._key, self._stamps = inner, key, stamps

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def commit(self) -> Any:
        self._stamps.append((self._key, time.monotonic()))
        return self._inner.commit()


def stamped(connector: Any, stamps: list) -> Any:
    """``connector`` seen through a proxy that appends ``(key, monotonic time)`` to ``stamps``
    the moment each payload is put (``put``, or a reservation's ``commit``), so a manager's
    readiness is measured from the put, as the baseline's and the primitives' are. The proxy
    offers ``reserve`` only when ``connector`` does (the manager picks its path by that)."""

    class Stamped:
        def __getattr__(self, name: str) -> Any:
            return getattr(connector, name)

        def put(self, from_stage: Any, to_stage: Any, put_key: str, data: Any) -> Any:
            stamps.append((put_key, time.monotonic()))
            return connector.put(from_stage, to_stage, put_key, data)

    if callable(getattr(connector, "reserve", None)):

        def reserve(self: Any, from_stage: Any, to_stage: Any, put_key: str, nbytes: int) -> Any:
            return _StampedReservation(connector.reserve(from_stage, to_stage, put_key, nbytes), put_key, stamps)

        Stamped.reserve = reserve  # type: ignore[attr-defined]
    return Stamped()


class GetWaits:
    """How many threads of a receive command have asked their connector for a payload (entered
    one of its payload gets, :func:`watched`) or ended, so that the command announces that
    it waits only once every rank's request is on its way to the sender. Each thread counts
    once per round (:meth:`reset`), however many gets it makes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0
        self._round = 0
        self._mine = threading.local()

    def reset(self) -> None:
        """A new round: no thread has asked yet."""
        with self._cond:
            self._count = 0
            self._round += 1

    def entered(self) -> None:
        """The calling thread asks for a payload now (or ended)."""
        with self._cond:
            if getattr(self._mine, "round", None) == self._round:
                return
            self._mine.round = self._round
            self._count += 1
            self._cond.notify_all()

    def count(self) -> int:
        with self._cond:
            return self._count

    def wait(self, count: int, timeout_s: float) -> bool:
        """True once ``count`` threads have entered this round; False after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._count >= count, timeout_s)


#: The connector methods that ask for a payload (the Connector, BlockingGet and GetMany abilities).
PAYLOAD_GETS = frozenset(("get", "get_blocking", "get_many"))


def watched(connector: Any, waits: GetWaits) -> Any:
    """``connector`` seen through a proxy that tells ``waits`` when a thread calls one of its
    :data:`PAYLOAD_GETS` (the receiving managers' connector in the benchmark worker)."""

    class Watched:
        def __getattr__(self, name: str) -> Any:
            value = getattr(connector, name)
            if name not in PAYLOAD_GETS:
                return value

            def call(*args: Any, **kwargs: Any) -> Any:
                waits.entered()
                return value(*args, **kwargs)

            return call

    return Watched()


class KvCommands:
    """``kv_*`` and ``mgr_*`` commands; mixed into the worker, whose attributes they use
    (``connectors``, ``kinds``, ``managers``, ``caches``, ``announce``)."""

    connectors: dict[str, Any]
    kinds: dict[str, str]
    managers: dict[str, dict[int, Any]]
    caches: dict[str, Any]
    #: ``(key, monotonic time)`` of every payload the sender's managers put (see :func:`stamped`).
    put_stamps: list
    #: The cache geometry of the last plan per ``(cache, heads)``, kept as a send path keeps it.
    plan_geometries: dict[tuple[str, Any], Any]
    #: Which receiving threads have asked for their payloads (see :func:`watched`).
    get_waits: GetWaits

    def announce(self) -> None:  # replaced per command by the channel
        """Tell the orchestrator this receive command now waits."""

    def cmd_kv_open(self, name: str, config: dict, sender: dict | None = None) -> dict[str, Any]:
        """Create a connector; a receiver is told its sender (``{"host", "port"}``) when it
        can be. Returns where a sender can be found (``host``/``port`` when it has them)."""
        from kvferry.app.registry import create_connector
        from kvferry.core.ports import SenderAware

        connector = create_connector(config)
        self.connectors[name] = connector
        self.kinds[name] = str(config.get("type"))
        info: dict[str, Any] = {"type": type(connector).__name__, **memory_kb()}
        if sender is not None and isinstance(connector, SenderAware):
            connector.update_sender_info(sender["host"], sender["port"])
        if config.get("role") == "sender":
            port = getattr(connector, "port", None)
            if isinstance(port, int):
                info["host"] = config.get("host", "127.0.0.1")
                info["port"] = port
        return info

    def cmd_kv_close(self, name: str) -> dict[str, Any]:
        for group in list(self.managers):
            for manager in self.managers.pop(group).values():
                manager.close()
        connector = self.connectors.pop(name, None)
        if connector is not None:
            connector.close()
        return {}

    def cmd_kv_send(
        self,
        name: str,
        cache: str,
        items: list[dict],
        checksums: str | None = None,
        from_stage: str = "0",
        to_stage: str = "1",
    ) -> dict[str, Any]:
        """Extract, encode and put every item (``{"request", "key", "rid", "heads"?}``) in order.

        A connector with ``reserve`` gets the extraction gathered straight into its pool; any
        other gets zero-copy frames of freshly materialised tensors.
        """
        from kvferry.app.bench.payload import encode_request, gather_payload_into, layout_for, plan_request
        from kvferry.core.errors import TransferError
        from kvferry.core.ports import Reservable

        connector = self.connectors[name]
        c = self.caches[cache]
        f0 = faults()
        t_go = time.monotonic()
        t_put, total = [], 0
        geometries = self.plan_geometries
        for item in items:
            heads = item.get("heads")
            span = None if heads is None else (heads[0], heads[1])
            plan = plan_request(
                c, item["request"], request_id=item["rid"], heads=span, geometry=geometries.get((cache, span))
            )
            geometries[cache, span] = plan.geometry
            if isinstance(connector, Reservable):
                layout = layout_for(plan, checksums=checksums)
                reservation = connector.reserve(from_stage, to_stage, item["key"], layout.total_nbytes)
                try:
                    gather_payload_into(plan, layout, reservation.buffer)
                except BaseException:
                    reservation.abort()
                    raise
                t_put.append(time.monotonic())
                ok, size, meta = reservation.commit()
            else:
                frames, _ = encode_request(plan, checksums=checksums)
                t_put.append(time.monotonic())
                ok, size, meta = connector.put(from_stage, to_stage, item["key"], frames)
            if not ok:
                raise TransferError(f"put {item['key']} failed: {meta}")
            total += size
        t_end = time.monotonic()
        return {"t_go": t_go, "t_end": t_end, "t_put": t_put, "faults": faults() - f0, "nbytes": total}

    def cmd_kv_recv(
        self, name: str, items: list[dict], timeout_s: float, from_stage: str = "0", to_stage: str = "1"
    ) -> dict[str, Any]:
        """Get (blocking) and decode every item (``{"key", "metadata"?}``), hold them all, stamp
        the time, then read every byte (crc32, untimed: a consumer's first touch) and release."""
        from kvferry.adapters.torch_frames import decode_payload
        from kvferry.app.bench.payload import payload_crc
        from kvferry.core.errors import TransferTimeout
        from kvferry.core.ports import BlockingGet, PoolBuffer

        connector = self.connectors[name]
        blocking = isinstance(connector, BlockingGet)
        self.announce()
        f0, c0 = faults(), cpu_s()
        deadline = time.monotonic() + timeout_s
        held, t_have, total = [], [], 0
        for item in items:
            metadata = item.get("metadata")
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(f"{item['key']} did not arrive within {timeout_s} s")
                if blocking:
                    got = connector.get_blocking(from_stage, to_stage, item["key"], metadata, timeout_s=remaining)
                else:
                    got = connector.get(from_stage, to_stage, item["key"], metadata)
                    if got is None:
                        time.sleep(0.0005)  # connector without arrival notification
                if got is not None:
                    break
            data, size = got
            decoded = decode_payload(data)
            t_have.append(time.monotonic())
            held.append((data, decoded))
            total += size
        t_done = time.monotonic()
        cpu = cpu_s() - c0  # up to the stamp: the untimed crc below is not the path's
        crcs = [payload_crc(decoded) for _, decoded in held]
        for data, _ in held:
            if isinstance(data, PoolBuffer) and not isinstance(data, (bytes, bytearray, memoryview)):
                data.release()
        held.clear()
        return {
            "t_done": t_done,
            "t_have": t_have,
            "crc": crcs,
            "faults": faults() - f0,
            "nbytes": total,
            "cpu_s": cpu,
        }

    # ------------------------------------------------------------------ the transfer manager
    def cmd_mgr_open(
        self,
        name: str,
        role: str,
        ranks: list[int],
        from_tp: int,
        to_tp: int,
        timeout_s: float = 60.0,
        connectors: list[str] | None = None,
        num_kv_heads: int | None = None,
        kv_layout: str | None = None,
    ) -> dict[str, Any]:
        """Managers group ``name``: one :class:`~kvferry.app.manager.KVTransferManager` per TP
        rank of this side (stage 0 sends to stage 1). Rank ``ranks[i]`` uses the connector
        ``connectors[i]`` opened by ``kv_open`` (default: the connector called ``name``)."""
        from kvferry.app.manager import KVTransferManager
        from kvferry.core.config import TransferConfig

        names = connectors or [name] * len(ranks)
        kind = self.kinds.get(names[0], "memory")
        raw: dict[str, Any] = {
            "connector_config": {"type": kind},
            "omni_from_stage": 0,
            "omni_to_stage": 1,
            "rank_mapping": {"from_tp": from_tp, "to_tp": to_tp},
            "num_kv_heads": num_kv_heads,
            "kv_layout": kv_layout,
        }
        if role == "sender":
            raw["need_send_cache"] = True
        else:
            raw.update(stage_id=1, engine_input_source=[0], need_recv_cache=True, recv_timeout=timeout_s)
        config = TransferConfig.from_omni_kv_config(raw)
        size = from_tp if role == "sender" else to_tp
        for old in self.managers.pop(name, {}).values():
            old.close()  # injected connectors stay open: they belong to this worker

        def connector(c: str) -> Any:
            if role == "sender":
                return stamped(self.connectors[c], self.put_stamps)
            return watched(self.connectors[c], self.get_waits)

        self.managers[name] = {
            r: KVTransferManager(config, tp_rank=r, tp_size=size, connector=connector(c)) for r, c in zip(ranks, names)
        }
        return {}

    def cmd_mgr_send(self, name: str, cache: str, items: list[dict]) -> dict[str, Any]:
        """``send_requests`` on each item's rank (``{"rank", "request", "rid"}``); one call per
        rank with all its requests, so the manager may overlap extraction and transfer."""
        from kvferry.app.bench.payload import cache_layers
        from kvferry.core.errors import TransferError

        name_, _, view = cache.partition(":")  # "main:latent": a view of the cache (payload.CACHE_VIEWS)
        c = self.caches[name_]
        g = c.geometry
        layers = cache_layers(c, view or None)
        by_rank: dict[int, dict[str, dict]] = {}
        for item in items:
            by_rank.setdefault(item["rank"], {})[item["rid"]] = {
                "block_ids": list(c.block_ids[item["request"]]),
                "seq_len": g.tokens,
            }
        self.put_stamps.clear()
        f0 = faults()
        t_go = time.monotonic()
        total = 0
        for rank, finished in by_rank.items():
            outcomes = self.managers[name][rank].send_requests(finished, layers, g.block_size, g.dtype)
            for outcome in outcomes:
                if not outcome.ok:
                    raise TransferError(f"rank {rank}: send of {outcome.request_id} failed: {outcome}")
                total += outcome.nbytes
        t_end = time.monotonic()
        # an item is put when the last of its keys is (the receiver needs them all)
        t_put = [max((t for key, t in self.put_stamps if _names(key, item["rid"])), default=t_go) for item in items]
        return {
            "t_go": t_go,
            "t_end": t_end,
            "t_put": t_put,
            "t_call": [t_go] * len(items),
            "faults": faults() - f0,
            "nbytes": total,
        }

    def cmd_mgr_recv(
        self, name: str, items: list[dict], timeout_s: float, sender: dict | None = None, copy: bool = False
    ) -> dict[str, Any]:
        """``receive`` each item (``{"rank", "rid"}``), hold the results, stamp the time, then
        read every byte (crc32, untimed) and release them (waiting until each pool took its
        buffer back, so the next repetition reuses the same pages). Each rank receives its items
        in order, in a thread of its own, as a TP group's ranks do in processes of their own
        (docs/benchmarks.md); the command announces that it waits once every rank has asked its
        connector for its first payload (:func:`watched`), so the sender starts against ranks
        that wait, not ranks still starting (``announce_wait_s`` in the result: how long that
        took; ``ranks_not_waiting``: ranks that had not asked by :data:`ANNOUNCE_WAIT_S`). The
        typed API's default receive (zero-copy: the tensors view the pool until released), or
        with ``copy`` the copying one (``zero_copy=False``, the compat layer's)."""
        from kvferry.app.bench.payload import kv_crc
        from kvferry.core.errors import TransferError

        info = None if sender is None else {"host": sender["host"], "zmq_port": sender["port"]}
        f0, c0 = faults(), cpu_s()
        deadline = time.monotonic() + timeout_s
        got: list[Any] = [None] * len(items)
        t_have = [0.0] * len(items)
        by_rank: dict[int, list[int]] = {}
        for at, item in enumerate(items):
            by_rank.setdefault(item["rank"], []).append(at)

        raised: list[BaseException] = []

        def receive_rank(ats: list[int]) -> None:
            try:
                for at in ats:
                    item = items[at]
                    result = self.managers[name][item["rank"]].receive(
                        item["rid"],
                        sender_info=info,
                        timeout_s=max(deadline - time.monotonic(), 0.001),
                        zero_copy=not copy,
                    )
                    t_have[at] = time.monotonic()
                    got[at] = result
                    if not result.ok:
                        return
            except BaseException as exc:  # raised in the command's thread below
                raised.append(exc)
            finally:  # a rank that ended before it asked does not hold the announcement up
                waits.entered()

        waits = self.get_waits
        waits.reset()
        threads = [
            threading.Thread(target=receive_rank, args=(ats,), name=f"bench-recv-{rank}", daemon=True)
            for rank, ats in by_rank.items()
        ]
        t_start = time.monotonic()
        for thread in threads:
            thread.start()
        not_waiting = 0 if waits.wait(len(threads), ANNOUNCE_WAIT_S) else len(threads) - waits.count()
        announce_wait = time.monotonic() - t_start
        self.announce()
        for thread in threads:  # every receive has the deadline; the join a margin past it
            thread.join(max(deadline - time.monotonic(), 0.0) + 30.0)
        held = [r for r in got if r is not None and r.ok]
        # a rank's failed receive is the reason; an item without a result (never asked for after
        # its rank failed, or its thread still running at the join) only when there is none
        bad = [(items[at], r) for at, r in enumerate(got) if r is not None and not r.ok] or [
            (items[at], None) for at, r in enumerate(got) if r is None
        ]
        if bad or raised:
            for result in held:
                result.release(wait=True)
            if raised:
                raise raised[0]
            item, result = bad[0]
            raise TransferError(
                f"rank {item['rank']}: receive of {item['rid']}: {'no result' if result is None else result.outcome}"
            )
        t_done = max(t_have)  # the last rank's receive, not the threads' joins
        total = sum(r.nbytes for r in held)
        cpu = cpu_s() - c0  # up to the joins: the untimed crc below is not the path's
        blocks = [r.payload["layer_blocks"] for r in held]
        crcs = [kv_crc(b["key_cache"], b["value_cache"]) for b in blocks]
        del blocks
        for result in held:  # back to the sender before the next repetition (as kv_recv does)
            result.release(wait=True)
        held.clear()
        return {
            "t_done": t_done,
            "t_have": t_have,
            "crc": crcs,
            "faults": faults() - f0,
            "nbytes": total,
            "cpu_s": cpu,
            "announce_wait_s": announce_wait,
            "ranks_not_waiting": not_waiting,
        }
