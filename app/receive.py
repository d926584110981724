"""The receive path: keys -> wait for arrival -> decode -> merge / slice -> usable tensors (SPEC 7).

One receive of one request on one receiver rank:

1. derive the receive keys (one per source rank) and, from the request's sender info, the
   endpoint each key is pulled from (``advertised + from_rank*16``);
2. wait until every key arrived or the deadline passed: the connector's blocking get (arrival
   notification) when it has one, else polling with 10 ms doubling to 500 ms sleeps;
3. decode each payload as views of the received memory, merge fan-in shards along the head
   dimension in source-rank order, slice an untagged fan-out payload to this rank's heads;
4. copying receive (the default, the reference's behaviour): move tensors to the target
   device, or clone them out of pool buffers, then release every pool buffer, on every path.
   Zero-copy receive (``zero_copy=True``): tensors stay views of the pool buffers; they are
   copied only to move to another device, by the fan-in merge (``torch.cat``), or, for data
   that is not a pool buffer (bytes, zmq frames), when ``copy_unpooled`` asks for it.

The result is a :class:`ReceiveResult`: a typed outcome plus the payload in the reference's
dict shape (``request_id``, ``layer_blocks``, ``block_ids``, ``metadata``). After a zero-copy
receive it holds the pool buffers its tensors still view (``result.buffers``; the others go
back before ``receive`` returns): ``result.release()`` gives them back (then the tensors must
not be read), else they go back once the result and every tensor over their bytes are garbage
(the tensors' storage owns the release, :mod:`kvferry.adapters.connectors.pool_buffer`; a
buffer that cannot be tied so, not a CPU byte view, goes back with the result object). Until
then the sender keeps the region (docs/connectors.md, "Holds").
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, cast

import attrs
import torch

from kvferry.adapters.checksums import arrived_checksums
from kvferry.adapters.connectors.pool_buffer import PooledBuffer, release_soon
from kvferry.adapters.torch_decode import given_bytes, host_byte_view, verify_arrived
from kvferry.adapters.torch_frames import DecodedKV, decode_payload, merge_layers, slice_layers
from kvferry.core.addressing import get_metadata
from kvferry.core.errors import (
    FailedAtSender,
    KVFerryError,
    LeaseExpired,
    PayloadError,
    SenderUnavailable,
    UnreadableGrant,
)
from kvferry.core.head_slices import applied_head_slice, fan_out_slice, tp_head_slice_record
from kvferry.core.header import DecodeLimits
from kvferry.core.ids import is_dummy_request, recv_keys
from kvferry.core.layouts import KV_LATENT_KEY, LayoutSpec
from kvferry.core.outcomes import ReceiveKind, ReceiveOutcome, SkipReason
from kvferry.core.policy import Deadline, PollBackoff
from kvferry.core.ports import BlockingGet, Clock, Connector, Implements
from kvferry.core.refusal import MARKER_MAX_BYTES, Refusal
from kvferry.core.routing import route_heads
from kvferry.core.scales import KV_SCALES_KEY, merge_scales, read_scales, slice_scales
from kvferry.core.sender_info import SenderEndpoint, resolve_sender
from kvferry.core.topology import TPTopology

__all__ = ["ReceivePath", "ReceiveResult", "finalize_tensors", "release_all"]

logger = logging.getLogger(__name__)


@attrs.frozen(eq=False)
class ReceiveResult:
    """A receive's outcome and, when it succeeded, the payload dict and its size in bytes.

    ``buffers``: the pool buffers a zero-copy receive's tensors view (empty for a copying
    receive); see the module doc for their hold semantics. Also a context manager (releases
    on exit)."""

    outcome: ReceiveOutcome
    payload: dict[str, Any] | None = None
    buffers: tuple[Any, ...] = ()

    @property
    def kv_scales(self) -> dict[str, Any] | None:
        """The FP8 scales that came with the KV (``metadata["kv_scales"]``, for this rank's
        heads), or None."""
        return None if self.payload is None else read_scales(self.payload.get("metadata"))

    @property
    def ok(self) -> bool:
        return self.outcome.ok and self.payload is not None

    @property
    def nbytes(self) -> int:
        return self.outcome.nbytes

    @property
    def held(self) -> bool:
        """True while any of :attr:`buffers` was not given back."""
        return any(not getattr(b, "released", False) for b in self.buffers)

    def release(self, *, wait: bool = False) -> None:
        """Give every held pool buffer back (idempotent). The payload's tensors that viewed
        them must not be read afterwards. ``wait``: return only once each pool took its region
        back (a round trip per buffer on shm); by default the releases are sent and this
        returns at once (the sender may reuse a region once its release arrived)."""
        release_all(list(self.buffers), wait=wait)

    def __enter__(self) -> ReceiveResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def release_all(items: list[Any], *, wait: bool = True) -> None:
    """Release every pool buffer among received items (idempotent releases; never raises).
    ``wait=False`` uses each buffer's fire-and-forget release where it has one."""
    for item in items:
        try:
            if wait:
                release = getattr(item, "release", None)
                if callable(release):
                    release()
            else:
                release_soon(item)
        except Exception:  # a release failure must not hide the receive's outcome
            logger.exception("releasing a pool buffer failed")


#: Most padding a marker's header may be followed by (the codec aligns tensor data to <= 4 KiB).
_MARKER_PAD_BYTES = 4096


def _header_only(data: Any) -> bool:
    """Whether ``data`` could be a refusal marker: a header and at most alignment padding after
    it (a marker carries no tensor bytes). Read from the length prefix alone, so an ordinary small
    payload is not decoded twice; frames (a list) are left to the decode."""
    tensor = getattr(data, "tensor", None) if not isinstance(data, torch.Tensor) else data
    # a tied pool buffer's own bytes: no torch call
    known = given_bytes(getattr(data, "host_bytes", None), tensor) if isinstance(tensor, torch.Tensor) else None
    try:
        if known is not None:
            view = known
        elif isinstance(tensor, torch.Tensor):
            view = host_byte_view(tensor)
        else:
            view = memoryview(data).cast("B")
    except TypeError:
        return True
    if view.nbytes < 4:
        return False
    header = int.from_bytes(view[:4], "big")
    return view.nbytes - 4 - header < _MARKER_PAD_BYTES


def _byte_len(data: Any) -> int:
    """Bytes of a received item (bytes-like, uint8 tensor, pool buffer, frames); unknown: a
    size past every marker."""
    tensor = getattr(data, "tensor", None) if not isinstance(data, torch.Tensor) else data
    if isinstance(tensor, torch.Tensor):
        return int(tensor.numel() * tensor.element_size())
    if isinstance(data, (list, tuple)):
        return sum(_byte_len(f) for f in data)
    try:  # bytes-like, zmq frames
        return memoryview(data).nbytes
    except TypeError:
        return MARKER_MAX_BYTES + 1


def _is_pooled(item: Any) -> bool:
    return callable(getattr(item, "release", None))


def _views_any(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    """True when ``tensor`` starts inside one of ``buffers`` (it is a view of received memory)."""
    ptr = tensor.data_ptr()
    return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() for b in buffers)


def _hold_of(item: Any) -> Any:
    """``item`` when its release already follows its views (a tied pool buffer), else a tied
    wrapper whose tensor's storage owns ``item``'s release (untied when it cannot be tied)."""
    if getattr(item, "tied_to_views", False):
        return item
    return PooledBuffer.tied(item.tensor, on_release=item.release, on_release_soon=lambda: release_soon(item))


def _still_viewed(payload: dict[str, Any], holds: list[Any]) -> tuple[Any, ...]:
    """The pool buffers some tensor of ``payload`` still views (the result must hold them)."""
    tensors = [
        t
        for name in ("key_cache", "value_cache")
        for t in payload["layer_blocks"].get(name, [])
        if isinstance(t, torch.Tensor)
    ]
    return tuple(h for h in holds if any(_views_any(t, [h.tensor]) for t in tensors))


def _already_decoded(data: Any, key: str) -> dict[str, Any] | None:
    """A payload dict a connector decoded itself (the reference uses it as is), else None.

    It must have the decoder's shape (``layer_blocks`` with ``key_cache``/``value_cache``
    lists): a dict without it is a PayloadError here, where the reference would report success
    and leave the request without KV."""
    if not isinstance(data, Mapping):
        return None
    blocks = data.get("layer_blocks")
    if not isinstance(blocks, Mapping) or not all(
        isinstance(blocks.get(n, []), (list, tuple)) for n in ("key_cache", "value_cache")
    ):
        raise PayloadError(f"invalid KV payload: the decoded payload dict under {key!r} has no layer_blocks lists")
    out = data if isinstance(data, dict) else dict(data)
    out["layer_blocks"] = {n: list(blocks.get(n) or ()) for n in ("key_cache", "value_cache")}  # same tensors
    out.setdefault("block_ids", [])
    out.setdefault("metadata", {})
    return out


def _plain_layers(blocks: Any) -> bool:
    """Whether ``blocks`` is already what :func:`finalize_tensors` makes of it: a dict of just
    ``key_cache`` and ``value_cache``, each a list."""
    return (
        type(blocks) is dict
        and len(blocks) == 2
        and type(blocks.get("key_cache")) is list
        and type(blocks.get("value_cache")) is list
    )


def finalize_tensors(
    payload: dict[str, Any], device: Any, must_copy: bool | Callable[[torch.Tensor], bool]
) -> dict[str, Any]:
    """Move every tensor of ``payload`` to ``device`` (None: stay), copying when ``must_copy``
    (the bytes live in a pool buffer about to be released, or in a read-only receive buffer);
    a callable ``must_copy`` decides per tensor."""
    blocks = payload["layer_blocks"]
    if device is None and must_copy is False and _plain_layers(blocks):
        return payload  # nothing to move or copy: the lists as they are (a model's 56 tensors, ~30 us)

    def fix(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if device is not None and torch.device(device) != t.device:
            return t.to(device, non_blocking=False)
        return t.clone() if (must_copy(t) if callable(must_copy) else must_copy) else t

    payload["layer_blocks"] = {name: [fix(t) for t in blocks.get(name, [])] for name in ("key_cache", "value_cache")}
    return payload


def _payload_heads(payload: Mapping[str, Any]) -> int | None:
    """Dim 1 (heads) of the payload's first present key tensor; None without one."""
    for t in (payload.get("layer_blocks") or {}).get("key_cache") or ():
        if isinstance(t, torch.Tensor):
            return int(t.shape[1]) if t.dim() >= 3 else None
    return None


def _merged_metadata(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """The first shard's metadata, with the FP8 scales of every shard merged in head order."""
    meta = dict(payloads[0]["metadata"])
    records = [read_scales(p.get("metadata")) for p in payloads]
    heads = [_payload_heads(p) or 0 for p in payloads]
    merged = merge_scales(records, heads)
    if merged is not None:
        meta[KV_SCALES_KEY] = merged
    return meta


@attrs.define(eq=False)
class ReceivePath:
    """Receives requests for one receiver rank. Thread-compatible (one receive at a time per
    request id); the manager runs prefetches on one background worker."""

    from_stage: Any
    to_stage: Any
    topology: TPTopology
    get_connector: Callable[[], Connector | None]
    clock: Clock
    sleep: Callable[[float], None]
    timeout_s: float
    poll: PollBackoff = attrs.field(factory=PollBackoff)
    key_builder: Callable[..., Any] | None = None
    merger: Callable[[list], Any] | None = None
    slicer: Callable[[Any], Any] | None = None
    #: Copy tensors out of receive buffers that are not pool buffers too (bytes, zmq frames), so
    #: callers get writable memory of their own. Pool buffers are copied unless zero-copy.
    copy_unpooled: bool = False
    #: Bounds on what a received header may claim (header bytes, tensors, layers, dimensions).
    limits: DecodeLimits = attrs.field(factory=DecodeLimits)
    #: The model's KV heads (all ranks); None: the reference's rank map (see docs/routing.md).
    num_heads: int | None = None
    #: The sender's cache layout; ``mla`` routes the latent (one sender per receiver, unsliced).
    layout: LayoutSpec | None = None
    _is_blocking: Implements = attrs.field(init=False, factory=lambda: Implements(BlockingGet))

    @property
    def routed_heads(self) -> int | None:
        """The head count keys and slices are routed with: 1 for an MLA latent, else the
        configured one (None: the reference's rank map)."""
        if self.layout is not None and not self.layout.has_heads:
            return 1
        return self.num_heads

    def keys(self, request_id: str) -> tuple[tuple[str, int | None], ...]:
        heads = None if self.topology.is_legacy else self.routed_heads
        return recv_keys(request_id, self.from_stage, self.to_stage, self.topology, self.key_builder, num_heads=heads)

    def key_metadata(
        self, endpoint: SenderEndpoint | None, from_rank: int | None, *, request_scoped: bool = False
    ) -> dict[str, Any] | None:
        """Connector metadata for one key, as the reference builds it
        (:func:`kvferry.core.addressing.get_metadata`; None: the connector's default sender)."""
        if endpoint is None:
            return None
        return get_metadata(endpoint.host, endpoint.port, from_rank, request_scoped=request_scoped)

    # ------------------------------------------------------------------------------ receive
    def receive(
        self,
        request_id: str,
        *,
        sender_info: Any = None,
        target_device: Any = None,
        timeout_s: float | None = None,
        receiving: bool = True,
        zero_copy: bool = True,
        stored_sender: SenderEndpoint | None = None,
    ) -> ReceiveResult:
        """Receive one request (see the module docstring). Never raises for remote faults.
        ``zero_copy``: see the module doc (the typed API's default). ``sender_info`` is the
        request's own sender (it must resolve to a host and a port); ``stored_sender`` the
        default one (metadata per key: :meth:`key_metadata`)."""
        if not request_id:
            return ReceiveResult(ReceiveOutcome.skipped("", SkipReason.NO_REQUEST_ID))
        if is_dummy_request(request_id):
            return ReceiveResult(ReceiveOutcome.skipped(request_id, SkipReason.DUMMY))
        if not receiving:
            return ReceiveResult(ReceiveOutcome.skipped(request_id, SkipReason.NOT_RECEIVING))
        start = self.clock.monotonic()
        endpoint = stored_sender
        request_scoped = sender_info is not None
        if request_scoped:
            resolution = resolve_sender(sender_info, self.from_stage)
            endpoint = resolution.endpoint
            reason = None if resolution.resolved and endpoint is not None else str(resolution.reason)
            if reason is None and endpoint is not None and endpoint.port is None:
                reason = "the request's sender info has a host but no port"  # the reference aborts too
            if reason is not None:
                logger.warning("request %s: sender info unresolved: %s", request_id, reason)
                return ReceiveResult(ReceiveOutcome.failed(request_id, ReceiveKind.SENDER_UNRESOLVED, reason))
        connector = self.get_connector()
        if connector is None:
            return ReceiveResult(
                ReceiveOutcome.failed(request_id, ReceiveKind.CONNECTOR_UNAVAILABLE, "no connector could be created")
            )
        try:
            keys = self.keys(request_id)
            metas = [self.key_metadata(endpoint, rank, request_scoped=request_scoped) for _, rank in keys]
        except KVFerryError as exc:
            return ReceiveResult(ReceiveOutcome.failed(request_id, ReceiveKind.ERROR, f"keys: {exc}"))
        deadline = Deadline(start, self.timeout_s if timeout_s is None else timeout_s)
        got: list[Any] = []
        expired: list[str] = []
        gone: list[str] = []
        unreadable: list[str] = []
        refused: list[Refusal] = []
        handed: list[Any] = []  # pool buffers a zero-copy result took over
        try:
            missing = self._wait_all(connector, keys, metas, deadline, got, expired, refused, gone, unreadable)
            names = tuple(k for k, _ in keys)

            def failed(kind: ReceiveKind, detail: str) -> ReceiveResult:
                outcome = ReceiveOutcome.failed(
                    request_id, kind, detail, keys=names, missing_keys=missing, seconds=self._since(start)
                )
                return ReceiveResult(outcome)

            if refused:
                logger.error("request %s: the sender refused: %s", request_id, refused[0].describe())
                return failed(ReceiveKind.REFUSED, refused[0].describe())
            if gone:
                logger.warning("request %s: %s", request_id, gone[0])
                return failed(ReceiveKind.SENDER_GONE, gone[0])
            if expired:
                return failed(ReceiveKind.EXPIRED, expired[0])
            if unreadable:
                logger.error("request %s: %s", request_id, unreadable[0])
                return failed(ReceiveKind.ERROR, unreadable[0])
            if missing:
                return failed(ReceiveKind.TIMED_OUT, f"{len(missing)} of {len(keys)} keys missing")
            return self._assemble(request_id, keys, got, target_device, start, handed if zero_copy else None)
        finally:
            taken = {id(x) for x in handed}
            release_all([data for data, _ in got if id(data) not in taken], wait=False)

    def _since(self, start: float) -> float:
        return max(0.0, self.clock.monotonic() - start)

    def _get_once(self, connector: Connector, key: str, meta: Any, remaining: float) -> Any:
        if self._is_blocking(connector):
            blocking = cast(BlockingGet, connector)  # the check above
            return blocking.get_blocking(str(self.from_stage), str(self.to_stage), key, meta, timeout_s=remaining)
        return connector.get(from_stage=str(self.from_stage), to_stage=str(self.to_stage), get_key=key, metadata=meta)

    def _wait_all(
        self,
        connector: Connector,
        keys: tuple,
        metas: list,
        deadline: Deadline,
        got: list,
        expired: list,
        refused: list,
        gone: list,
        unreadable: list,
    ) -> tuple[str, ...]:
        """Fill ``got`` with ``(data, size)`` per key in order; return the keys still missing.

        A key whose lease expired at the sender ends the wait at once (its reason goes to
        ``expired``): the request cannot complete. So does a refusal marker (the sender could
        not send; its :class:`~kvferry.core.refusal.Refusal` goes to ``refused``), and a sender
        the connector found dead (SenderUnavailable from a blocking get; its reason goes to
        ``gone``), a key its sender recorded it will never publish (FailedAtSender: a refusal in
        ``refused``) and a grant this receiver cannot read (UnreadableGrant, to
        ``unreadable``): none of them can come by waiting."""
        blocking = self._is_blocking(connector)
        pending = list(range(len(keys)))
        results: dict[int, Any] = {}
        polls = 0
        while pending:
            for i in list(pending):
                remaining = deadline.remaining(self.clock.monotonic())
                try:
                    result = self._get_once(connector, keys[i][0], metas[i], remaining)
                except LeaseExpired as exc:
                    expired.append(f"{keys[i][0]}: {exc}")
                    break
                except SenderUnavailable as exc:  # the sender died: the key cannot come
                    gone.append(f"{keys[i][0]}: {exc}")
                    break
                except FailedAtSender as exc:  # the sender recorded that it will not publish the key
                    refused.append(Refusal(exc.kind, str(exc), "see the sender's log for why it failed the key"))
                    break
                except UnreadableGrant as exc:  # granted, but not readable here: asking again cannot help
                    unreadable.append(f"{keys[i][0]}: {exc}")
                    break
                if result is not None:
                    results[i] = result
                    pending.remove(i)
                    refusal = self.refusal_of(result[0])
                    if refusal is not None:
                        refused.append(refusal)
                        break
                elif blocking:
                    break  # the deadline passed while blocked on this key
            if not pending or expired or refused or gone or unreadable:
                break
            remaining = deadline.remaining(self.clock.monotonic())
            if remaining <= 0.0:
                break
            # polling; or a blocking get that answered None before the deadline (the sender
            # said the key cannot come now: busy, closing, unreachable): back off, never spin
            self.sleep(self.poll.next_sleep(polls, remaining))
            polls += 1
        got.extend(results[i] for i in sorted(results))
        return tuple(keys[i][0] for i in pending)

    def refusal_of(self, data: Any) -> Refusal | None:
        """The refusal a received item carries (a marker is a small header-only payload), else
        None; a payload that does not decode is left to the ordinary checks."""
        if isinstance(data, Mapping):  # a payload dict a foreign connector decoded itself
            return Refusal.from_metadata(data.get("metadata"))
        if _byte_len(data) > MARKER_MAX_BYTES or not _header_only(data):
            return None
        try:
            decoded = decode_payload(data, limits=self.limits)
        except PayloadError:
            return None
        return Refusal.from_metadata(decoded.metadata)

    def _assemble(
        self, request_id: str, keys: tuple, got: list, device: Any, start: float, handed: list | None
    ) -> ReceiveResult:
        """Decode, merge, finalize. ``handed`` None: copying receive. Else zero-copy: every
        pool buffer is taken over (appended to ``handed``); those the result does not keep
        are given back before this returns."""
        holds: list[Any] = []
        sources: list[Any] = []
        for data, _ in got:
            if handed is not None and _is_pooled(data) and getattr(data, "tensor", None) is not None:
                hold = _hold_of(data)
                holds.append(hold)
                handed.append(data)
                sources.append(hold)  # decoded as a pool buffer: through its host_bytes when it has them
            else:
                sources.append(data)
        result: ReceiveResult | None = None
        try:
            result = self._assemble_decoded(request_id, keys, got, sources, holds, device, start)
            return result
        finally:
            kept = {id(b) for b in result.buffers} if result is not None else set()
            release_all([h for h in holds if id(h) not in kept], wait=False)

    def _assemble_decoded(
        self, request_id: str, keys: tuple, got: list, sources: list, holds: list, device: Any, start: float
    ) -> ReceiveResult:
        names = tuple(k for k, _ in keys)
        total = sum(int(size) for _, size in got)
        decoded: list[DecodedKV | dict[str, Any]] = []
        try:
            for source, key in zip(sources, names):
                decoded.append(_already_decoded(source, key) or self._decode(source))
            if self.key_builder is None:  # kvferry's keys carry the id the sender wrote inside
                for d, key in zip(decoded, names):
                    rid = d.get("request_id") if isinstance(d, dict) else d.request_id
                    if rid != request_id:
                        raise PayloadError(f"payload under {key!r} belongs to request {rid!r}, not {request_id!r}")
        except PayloadError as exc:
            logger.warning("request %s: undecodable payload: %s", request_id, exc)
            return ReceiveResult(
                ReceiveOutcome.failed(
                    request_id,
                    ReceiveKind.DECODE_FAILED,
                    str(exc),
                    keys=names,
                    nbytes=total,
                    seconds=self._since(start),
                )
            )
        try:
            payload = self._combine([d if isinstance(d, dict) else d.to_reference_dict() for d in decoded])
            del decoded
            kept: tuple[Any, ...] = ()
            if holds:
                views = [h.tensor for h in holds]
                unpooled = self.copy_unpooled and len(holds) < len(got)
                payload = finalize_tensors(payload, device, (lambda t: not _views_any(t, views)) if unpooled else False)
                kept = _still_viewed(payload, holds)
            else:
                pooled = [data for data, _ in got if _is_pooled(data)]
                must_copy: Any = bool(pooled) or self.copy_unpooled
                views = [getattr(p, "tensor", None) for p in pooled]
                if (
                    len(got) > 1
                    and self.merger is None
                    and not self.copy_unpooled
                    and all(isinstance(v, torch.Tensor) for v in views)
                ):
                    # torch.cat made fresh tensors, but a layer only one shard carried is still a view
                    must_copy = lambda t: _views_any(t, views)  # noqa: E731
                payload = finalize_tensors(payload, device, must_copy)
        except (KVFerryError, ValueError, RuntimeError) as exc:
            return ReceiveResult(
                ReceiveOutcome.failed(
                    request_id,
                    ReceiveKind.CONSUMED_BUT_FAILED,
                    f"post-processing: {exc}",
                    keys=names,
                    nbytes=total,
                    seconds=self._since(start),
                )
            )
        result = ReceiveResult(
            ReceiveOutcome.received(request_id, keys=names, nbytes=total, seconds=self._since(start)), payload, kept
        )
        for hold in kept:
            if not getattr(hold, "tied_to_views", False):  # cannot follow its views: follow the result
                weakref.finalize(result, release_soon, hold).atexit = False
        return result

    def _decode(self, source: Any) -> DecodedKV:
        """Decode and verify one payload; checksums the transport computed as the bytes arrived
        (a streamed zmq receive) are compared instead of reading those tensors again."""
        arrived = arrived_checksums(source)
        if arrived is None:
            return decode_payload(source, limits=self.limits)
        decoded = decode_payload(source, defer_verify=True, limits=self.limits)
        verify_arrived(decoded, arrived)
        return decoded

    def _combine(self, payloads: list[dict[str, Any]]) -> dict[str, Any]:
        """Merge fan-in shards (source-rank order) and slice an untagged fan-out payload. A
        merger hook that returns None leaves the payloads to the default merge."""
        merged = self.merger(payloads) if self.merger is not None else None
        if merged is None and len(payloads) == 1:
            merged = payloads[0]
        elif merged is None:
            first = payloads[0]
            merged = {
                "request_id": first["request_id"],
                "block_ids": list(first["block_ids"]),
                "metadata": _merged_metadata(payloads),
                "layer_blocks": {
                    name: merge_layers([p["layer_blocks"][name] for p in payloads])
                    for name in ("key_cache", "value_cache")
                },
            }
        if self.slicer is not None:
            return self.slicer(merged)
        return self._slice_if_needed(merged)

    def _slice_if_needed(self, payload: dict[str, Any]) -> dict[str, Any]:
        topo = self.topology
        if topo.is_legacy or not topo.is_fan_out:
            return payload
        meta = payload.get("metadata") or {}
        if isinstance(meta, Mapping) and meta.get(KV_LATENT_KEY):
            return payload  # an MLA latent: every rank holds it whole, never sliced
        tag = applied_head_slice(meta)
        if tag is not None:
            if tag.get("target_rank") != topo.local_rank:
                logger.warning(
                    "payload %s was sliced for rank %s, received on rank %s",
                    payload.get("request_id"),
                    tag.get("target_rank"),
                    topo.local_rank,
                )
            return payload
        heads = self.routed_heads
        if heads is None:
            offset, slices = fan_out_slice(topo.source_tp, topo.target_tp, topo.local_rank)
            source = topo.local_rank // (topo.target_tp // topo.source_tp)
        else:
            (route,) = route_heads(topo.source_tp, topo.target_tp, heads).reads(topo.local_rank)
            offset, slices, source = route.offset_in_shard, route.num_slices, route.source_rank
        blocks = payload["layer_blocks"]
        meta = dict(meta)
        scales = read_scales(meta)
        heads_in = _payload_heads(payload)
        if scales is not None and slices > 1 and heads_in is not None:
            width = heads_in // slices
            meta[KV_SCALES_KEY] = slice_scales(scales, offset * width, (offset + 1) * width)
        meta["tp_head_slice"] = tp_head_slice_record(
            "receiver", source, topo.local_rank, topo.source_tp, topo.target_tp, offset, slices
        )
        if slices == 1:
            return {**payload, "metadata": meta}
        return {
            **payload,
            "metadata": meta,
            "layer_blocks": {
                name: slice_layers(blocks.get(name), offset, slices) for name in ("key_cache", "value_cache")
            },
        }
