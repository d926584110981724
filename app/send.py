"""The send path: paged cache -> one payload per target key -> connector (SPEC 4, 7).

For each finished request: plan the extraction (shapes only), build the send keys, and for
each key write the payload by the connector's fastest path:

- a :class:`~kvferry.core.ports.Reservable` connector gets the payload gathered straight into
  its pool (the only copy of the tensor bytes on the sender);
- a :class:`~kvferry.core.ports.FramesPut` connector (kvferry's own) gets zero-copy frames
  (header + tensor memoryviews) of tensors gathered once into fresh memory;
- any other connector (one written for the reference) gets what the reference gives it: one
  ``bytes`` payload, or one device ``uint8`` tensor when it says ``supports_raw_data`` and the
  KV is on a device.

When fanning out (sender TP < receiver TP) each key carries only its receiver's heads: the
gather reads just those heads of every block, and the payload is tagged ``tp_head_slice``
(side "sender") so the receiver never slices it again. Into a reservable connector every key's
region is reserved first and the slices are gathered in one pass over the cache
(:func:`~kvferry.adapters.paged_cache.gather_slices`), then committed.

Every request gets a :class:`~kvferry.core.outcomes.SendOutcome`; puts are retried (3
attempts, 0.1 s doubling backoff by default) and a full pool is reported as ``pool_full``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import attrs

from kvferry.adapters.paged_cache import (
    CacheGeometry,
    ExtractionPlan,
    ExtractionSkipped,
    plan_extraction,
)
from kvferry.adapters.payload_lane import HeadSlices, Slot, gather_payload, gather_slice_payloads
from kvferry.adapters.torch_frames import (
    encode_bytes,
    encode_device_tensor,
    encode_frames,
    finish_payload_in,
)
from kvferry.app.put import put_with_retry
from kvferry.app.refusals import refuse
from kvferry.core.errors import ConfigError, KVFerryError, RoutingError
from kvferry.core.head_slices import fan_out_slice, tp_head_slice_record
from kvferry.core.header import kv_layout_template
from kvferry.core.ids import send_keys
from kvferry.core.layouts import KV_LATENT_KEY, LayoutSpec
from kvferry.core.outcomes import SendOutcome, SendReason
from kvferry.core.policy import RetryPolicy
from kvferry.core.ports import Clock, Connector, FramesPut, Implements, Reservable
from kvferry.core.routing import rank_heads, route_heads
from kvferry.core.scales import KV_SCALES_KEY, scales_record, slice_scales
from kvferry.core.topology import TPTopology, target_ranks

__all__ = ["SendPath", "KeyJob", "slice_plan_heads", "request_scales"]

logger = logging.getLogger(__name__)

#: Layout templates a send path keeps (one per tensor shape signature; all dropped when full).
_TEMPLATES_KEPT = 64
#: A failed put's reason (:func:`kvferry.app.put.put_with_retry`) as the request's outcome.
_SEND_REASONS = {"pool_full": SendReason.POOL_FULL, "error": SendReason.ERROR}


def _uniform_tokens(plan: ExtractionPlan) -> int | None:
    """The token count of a plan whose every layer is present over a uniform cache (planned in
    one selection: each tensor's shape is then its view's token shape after it), else None.
    Plans come from ``plan_extraction`` (a head slice has no geometry)."""
    geometry, first = plan.geometry, plan.keys[0] if plan.keys else None
    if geometry is None or geometry.uniform is None or first is None or plan.skipped_layers:
        return None
    return first.tokens


def slice_plan_heads(plan: ExtractionPlan, offset_in_shard: int, num_slices: int) -> ExtractionPlan:
    """The same extraction restricted to one head slice (dim 2 of each block view):
    :meth:`~kvferry.adapters.paged_cache.ExtractionPlan.head_slice`, refused for an MLA latent.

    Bounds come from :func:`kvferry.core.head_slices.slice_bounds`, the function the receiver
    uses too. No data moves: the gathers read strided views of the cache.
    """
    if num_slices == 1:
        return plan
    if plan.metadata.get(KV_LATENT_KEY):
        raise RoutingError(
            "cannot slice an MLA latent by heads: it has no head dimension, and every TP rank holds "
            "the whole latent (each receiver gets it whole from one sender)"
        )
    return plan.head_slice(offset_in_shard, num_slices)


def request_scales(kv_scales: Mapping[str, Any], plan: ExtractionPlan) -> dict[str, Any]:
    """The ``kv_scales`` record of one request (:func:`kvferry.core.scales.scales_record`) from
    the cache's scales: per-block scales are picked for the blocks each layer's payload carries,
    in order; absent layers get None. ConfigError naming the field for a layer count that is not
    the cache's or a block id the scales do not cover."""
    if not isinstance(kv_scales, Mapping):
        raise ConfigError(f"kv_scales must be a mapping, got {type(kv_scales).__name__}")
    granularity = kv_scales.get("granularity", "layer")

    def per_layer(name: str) -> list[Any] | None:
        values = kv_scales.get(name)
        if values is None:
            return None
        if len(values) != plan.num_layers:
            raise ConfigError(f"kv_scales.{name} has {len(values)} layers, the cache {plan.num_layers}")
        out: list[Any] = []
        for layer, (entry, gather) in enumerate(zip(values, plan.keys)):  # K and V share block ids
            if entry is None or gather is None:
                out.append(None)
                continue
            entry = entry.tolist() if hasattr(entry, "tolist") else entry
            if granularity == "block":
                try:
                    entry = [entry[b] for b in gather.block_ids]
                except (IndexError, TypeError):
                    raise ConfigError(
                        f"kv_scales.{name}[{layer}] does not cover block ids {list(gather.block_ids)}"
                    ) from None
            out.append(entry)
        return out

    k = per_layer("k_scale")
    if k is None:
        raise ConfigError("kv_scales.k_scale is required")
    return scales_record(granularity, k, per_layer("v_scale"))


@attrs.frozen
class _Shaped:
    """What fixes a plan's tensor shapes (and so its layout template): a uniform cache's
    ``geometry`` and the request's ``tokens`` (:func:`_uniform_tokens`), and for a head slice
    of such a plan its ``slot`` ``(offset_in_shard, num_slices)``."""

    geometry: CacheGeometry | None
    tokens: int
    slot: Slot | None = None

    @property
    def key(self) -> tuple[int, Slot | None]:
        return (self.tokens, self.slot)


@attrs.frozen
class KeyJob:
    """One payload to put: its key, the receiver rank it feeds (None when a hook chose keys)
    and the head slice it carries."""

    key: str
    target_rank: int | None
    offset_in_shard: int = 0
    num_slices: int = 1


@attrs.define(eq=False)
class SendPath:
    """Sends finished requests of one sender rank. Thread-compatible, not thread-safe."""

    from_stage: Any
    to_stage: Any
    topology: TPTopology
    get_connector: Callable[[], Connector | None]
    clock: Clock
    sleep: Callable[[float], None]
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    key_builder: Callable[..., Any] | None = None
    align: int = 64
    checksums: str | None = None
    #: The model's KV heads (all ranks); None: the reference's rank map (inferred on fan-out).
    num_heads: int | None = None
    #: The paged cache's layout name; None: recognised by shape (:mod:`kvferry.core.layouts`).
    layout: LayoutSpec | None = None
    _is_reservable: Implements = attrs.field(init=False, factory=lambda: Implements(Reservable))
    _takes_frames: Implements = attrs.field(init=False, factory=lambda: Implements(FramesPut))
    _templates: dict[tuple, Any] = attrs.field(init=False, factory=dict)  # see _layout
    #: The uniform cache last sent from and its templates by token count and head slot (see
    #: _layout and _Shaped).
    _by_tokens: tuple[CacheGeometry | None, dict[tuple[int, Slot | None], Any]] = attrs.field(
        init=False, factory=lambda: (None, {})
    )
    #: the native copies of this sender's cache, prepared once (adapters.payload_lane)
    _lanes: dict[str, Any] = attrs.field(init=False, factory=dict)
    #: The last request's cache geometry: the next request of the same cache plans with it.
    _geometry: CacheGeometry | None = attrs.field(init=False, default=None, repr=False)

    # ------------------------------------------------------------------------------ planning
    def routed_heads(self, shard_heads: int | None = None) -> int | None:
        """The head count this rank routes with: 1 for an MLA latent; the configured one
        (checked against ``shard_heads``, the heads the rank's cache holds, when known); on
        fan-out without one, ``shard_heads * source_tp`` (the receivers' pairs do not depend on
        it, and it is exact whenever a rank holds more than one head); else None (the
        reference's rank map)."""
        topo = self.topology
        if self.layout is not None and not self.layout.has_heads:
            return 1
        if self.num_heads is not None:
            if shard_heads is not None and not topo.is_legacy:
                start, stop = rank_heads(topo.source_tp, self.num_heads, topo.local_rank)
                if stop - start != shard_heads:
                    raise RoutingError(
                        f"the cache of sender rank {topo.local_rank} holds {shard_heads} KV heads, but "
                        f"num_kv_heads={self.num_heads} at source_tp={topo.source_tp} gives it {stop - start}"
                    )
            return self.num_heads
        if topo.is_fan_out and shard_heads is not None:
            return shard_heads * topo.source_tp
        return None

    def jobs(self, request_id: str, shard_heads: int | None = None) -> tuple[KeyJob, ...]:
        """The payloads this rank puts for ``request_id`` (one per target key; a sender replica
        that serves no receiver puts none)."""
        topo = self.topology
        heads = self.routed_heads(shard_heads)
        keys = send_keys(
            request_id,
            self.from_stage,
            self.to_stage,
            topo,
            self.key_builder,
            num_heads=None if topo.is_legacy else heads,
        )
        if topo.is_legacy:
            return tuple(KeyJob(k, None) for k in keys)
        if heads is None:
            targets = target_ranks(topo)
            if len(keys) != len(targets):  # a hook chose other keys: send whole shards
                return tuple(KeyJob(k, None) for k in keys)
            out = []
            for key, target in zip(keys, targets):
                offset, slices = fan_out_slice(topo.source_tp, topo.target_tp, target)
                out.append(KeyJob(key, target, offset, slices))
            return tuple(out)
        routes = route_heads(topo.source_tp, topo.target_tp, heads).sends(topo.local_rank)
        if len(keys) != len(routes):
            return tuple(KeyJob(k, None) for k in keys)
        return tuple(KeyJob(k, r.target_rank, r.offset_in_shard, r.num_slices) for k, r in zip(keys, routes))

    # ------------------------------------------------------------------------------- sending
    def send(
        self,
        request_id: str,
        kv_caches: Sequence[Any],
        block_ids: Any,
        seq_len: int,
        block_size: int,
        cache_dtype: Any,
        custom_metadata: Mapping[str, Any] | None = None,
        kv_scales: Mapping[str, Any] | None = None,
    ) -> SendOutcome:
        """Extract, encode and put one request; never raises for transfer faults.

        ``kv_scales``: the FP8 cache's dequantisation scales, ``{"granularity": "layer" | "head"
        | "block", "k_scale": [...], "v_scale": [...]}`` with one entry per layer of the cache (a
        number; a list per head of this rank; a list or 1-D tensor indexed by block id). They
        travel in the payload's metadata (``kv_scales``, :mod:`kvferry.core.scales`): per-block
        ones for the request's blocks only, per-head ones cut with the heads."""
        start = self.clock.monotonic()
        connector = self.get_connector()
        if connector is None:
            logger.error(
                "request %s: KV not sent: no connector could be created (the receiving stage cannot be told; "
                "fix connector_config, see the error at start)",
                request_id,
            )
            return SendOutcome.failed(request_id, SendReason.CONNECTOR_UNAVAILABLE, "no connector")
        try:
            plan = plan_extraction(
                kv_caches,
                block_ids,
                seq_len,
                block_size,
                cache_dtype=cache_dtype,
                custom_metadata=custom_metadata,
                request_id=request_id,
                layout=self.layout,
                geometry=self._geometry,
            )
        except KVFerryError as exc:
            return refuse(self, connector, request_id, kv_caches, SendReason.ERROR, f"extraction: {exc}", exc)
        if isinstance(plan, ExtractionSkipped):
            reason = SendReason.NO_BLOCKS if plan.reason == "no_block_ids" else SendReason.NO_PAYLOAD
            return refuse(self, connector, request_id, kv_caches, reason, plan.detail)
        self._geometry = plan.geometry
        if kv_scales is not None:
            try:
                plan = attrs.evolve(plan, metadata={**plan.metadata, KV_SCALES_KEY: request_scales(kv_scales, plan)})
            except KVFerryError as exc:
                return refuse(self, connector, request_id, kv_caches, SendReason.ERROR, f"kv_scales: {exc}", exc)
        try:
            jobs = self.jobs(request_id, plan.shard_heads)
        except KVFerryError as exc:
            logger.error("request %s: KV not sent: no keys (%s); the receiving stage cannot be told", request_id, exc)
            return SendOutcome.failed(request_id, SendReason.ERROR, f"keys: {exc}")
        sent: list[str] = []
        failed: list[str] = []
        nbytes = attempts = 0
        last_reason, last_detail = SendReason.PUT_FAILED, ""
        materialized: dict[tuple[int, int], Any] = {}
        together = self._put_slices_together(connector, plan, jobs)
        for job in jobs:
            if job.key in together:  # put by the one-pass fan-out gather
                ok, size, tries, reason, detail = True, together[job.key], 1, SendReason.PUT_FAILED, ""
            else:
                ok, size, tries, reason, detail = self._put_one(connector, plan, job, materialized)
            attempts += tries
            if ok:
                sent.append(job.key)
                nbytes += size
            else:
                failed.append(job.key)
                last_reason, last_detail = reason, detail
        seconds = max(0.0, self.clock.monotonic() - start)
        if failed:
            return refuse(
                self,
                connector,
                request_id,
                kv_caches,
                last_reason,
                f"{len(failed)} of {len(jobs)} keys not put: {last_detail}",
                keys=failed,
                failed_keys=failed,
                nbytes=nbytes,
                sent_keys=sent,
                attempts=attempts,
                seconds=seconds,
            )
        logger.debug(
            "request %s: sent %d bytes in %d keys (%.3f s, %.1f MB/s)",
            request_id,
            nbytes,
            len(sent),
            seconds,
            nbytes / 1e6 / seconds if seconds else float("inf"),
        )
        return SendOutcome.sent(request_id, keys=sent, nbytes=nbytes, attempts=attempts, seconds=seconds)

    def _metadata(self, plan: ExtractionPlan, job: KeyJob) -> dict[str, Any]:
        meta = plan.metadata
        scales = meta.get(KV_SCALES_KEY)
        if scales is not None and job.num_slices > 1 and plan.shard_heads is not None:
            width = plan.shard_heads // job.num_slices
            meta[KV_SCALES_KEY] = slice_scales(scales, job.offset_in_shard * width, (job.offset_in_shard + 1) * width)
        if job.target_rank is not None and (job.num_slices > 1 or self.topology.is_fan_out):
            # every fan-out payload is tagged (a whole one-head shard too): never sliced again
            topo = self.topology
            meta["tp_head_slice"] = tp_head_slice_record(
                "sender",
                topo.local_rank,
                job.target_rank,
                topo.source_tp,
                topo.target_tp,
                job.offset_in_shard,
                job.num_slices,
            )
        return meta

    def _put_one(
        self, connector: Connector, plan: ExtractionPlan, job: KeyJob, materialized: dict
    ) -> tuple[bool, int, int, SendReason, str]:
        """Put one key with retries: ``(ok, size, attempts, reason, detail)``."""
        try:
            sliced = slice_plan_heads(plan, job.offset_in_shard, job.num_slices)
        except KVFerryError as exc:
            return False, 0, 0, SendReason.ERROR, f"head slice: {exc}"
        meta = self._metadata(plan, job)

        def attempt() -> tuple[bool, int, Any]:
            if self._is_reservable(connector):
                return self._put_reserved(connector, sliced, job.key, meta)
            return self._put_frames(connector, sliced, job, meta, materialized)

        done = put_with_retry(attempt, self.retry, self.sleep)
        if done.ok:
            return True, done.size, done.attempts, SendReason.PUT_FAILED, ""
        return False, 0, done.attempts, _SEND_REASONS.get(done.reason, SendReason.PUT_FAILED), done.detail

    def _put_slices_together(
        self, connector: Connector, plan: ExtractionPlan, jobs: tuple[KeyJob, ...]
    ) -> dict[str, int]:
        """Fan-out into a reservable connector: every key's region reserved, every head slice
        gathered in one pass over the cache (``gather_slices``), then each key committed. Keys
        that carry the same slice (replicated receivers, an MLA latent to several receivers) are
        gathered once; the others get a copy of its tensor bytes (one contiguous copy).
        Returns ``{key: size}`` of the keys put; a key missing from it (nothing applies, a
        reservation, a local fault or a commit failed) goes through :meth:`_put_one` (with its
        retries) instead."""
        if len(jobs) < 2 or any(j.target_rank is None for j in jobs) or not self._is_reservable(connector):
            return {}
        slots = [(j.offset_in_shard, j.num_slices) for j in jobs]
        first = {slot: i for i, slot in reversed(list(enumerate(slots)))}  # slot -> its first job
        same_as = [None if first[slot] == i else first[slot] for i, slot in enumerate(slots)]
        if all(k is None for k in same_as) and any(j.num_slices < 2 for j in jobs):
            return {}  # nothing shared: the one-pass gather needs slices
        slices = HeadSlices(plan, tuple(slots), slice_plan_heads)  # each planned only if needed
        try:
            filled = self._fill_reserved(connector, slices, [(j.key, self._metadata(plan, j)) for j in jobs], same_as)
        except KVFerryError:  # a full pool, a local fault: each key takes the single path
            return {}
        put: dict[str, int] = {}
        for job, reservation in zip(jobs, filled):
            ok, size, _ = reservation.commit()
            if ok:
                put[job.key] = size
        return put

    def _fill_reserved(
        self,
        connector: Any,
        source: ExtractionPlan | HeadSlices,
        entries: Sequence[tuple[str, dict[str, Any]]],
        same_as: Sequence[int | None] | None = None,
    ) -> list[Any]:
        """Reserve a region per ``(key, metadata)`` entry, gather what the entry carries into it
        and write the headers; the reservations, ready to commit. ``source``: one plan (one
        entry), or one request's head slices (entry ``i`` carries slice ``source.slots[i]``),
        gathered in one pass over the cache through the sender's slice lane: a request the lane
        serves, of a token count seen before, is never sliced (see :meth:`_layouts`).
        ``same_as[i] = k`` (``k < i``): entry ``i`` carries the same tensors as entry ``k``, so
        its tensor bytes are copied from ``k``'s region, or written from the same read when
        every slice goes to as many receivers. Any exception aborts every reservation taken."""
        reservations: list[Any] = []
        try:
            layouts = self._layouts(source, entries)
            for (key, _), layout in zip(entries, layouts):
                reservations.append(
                    connector.reserve(str(self.from_stage), str(self.to_stage), key, layout.total_nbytes)
                )
            shared = list(same_as) if same_as is not None else [None] * len(entries)
            gathered = [i for i, k in enumerate(shared) if k is None]
            holders = {i: [i] for i in gathered}  # item -> the items that carry its tensors
            for i, k in enumerate(shared):
                if k is not None:
                    holders[k].append(i)
            copies = len(holders[gathered[0]])
            if copies > 1 and all(len(h) == copies for h in holders.values()):
                # every slice to each of its receivers from one read of the cache (replicated
                # heads, a latent for several receivers): no copy between regions afterwards
                written = [i for k in gathered for i in holders[k]]
                shared = [None] * len(entries)
            else:
                written, copies = gathered, 1
            if isinstance(source, HeadSlices):
                gather_slice_payloads(
                    source.only(gathered),
                    [reservations[i].buffer for i in written],
                    [layouts[i] for i in written],
                    copies,
                    self._lanes,
                )
            else:  # one payload: the cache's native copies, prepared once
                gather_payload(source, reservations[0].buffer, layouts[0], self._lanes)
            for i, k in enumerate(shared):
                if k is not None:  # same tensors, same offsets from the data start: one copy
                    src, dst = layouts[k], layouts[i]
                    count = src.total_nbytes - src.data_start
                    if count != dst.total_nbytes - dst.data_start:
                        raise ConfigError(f"{entries[i][0]}: payload differs in size from {entries[k][0]}")
                    reservations[i].buffer[dst.data_start : dst.total_nbytes].copy_(
                        reservations[k].buffer[src.data_start : src.total_nbytes]
                    )
            for reservation, layout in zip(reservations, layouts):
                finish_payload_in(reservation.buffer, layout, getattr(reservation, "host_bytes", None))
        except BaseException:
            for reservation in reservations:
                reservation.abort()
            raise
        return reservations

    def _layouts(self, source: ExtractionPlan | HeadSlices, entries: Sequence[tuple[str, dict[str, Any]]]) -> list[Any]:
        """Each entry's payload layout (see :meth:`_fill_reserved`). A head slice of a uniform
        cache's plan has its template found by the cache, the token count and its slot; its
        plan is made only when that template is new."""
        if not isinstance(source, HeadSlices):
            return [self._layout(source, meta) for _, meta in entries]
        tokens = _uniform_tokens(source.whole)
        if tokens is None:
            return [self._layout(source.plan(i), meta) for i, (_, meta) in enumerate(entries)]
        return [
            self._layout(source.whole, meta, _Shaped(source.geometry, tokens, slot), partial(source.plan, i))
            for i, ((_, meta), slot) in enumerate(zip(entries, source.slots, strict=True))
        ]

    def _layout(
        self,
        plan: ExtractionPlan,
        meta: dict[str, Any],
        shaped: _Shaped | None = None,
        shapes_of: Callable[[], ExtractionPlan] | None = None,
    ) -> Any:
        """The payload layout: the part fixed by the tensors' dtypes and shapes (a template) is
        kept per shape signature, so a request of a shape seen before only renders its header.
        A plan of a uniform cache (:attr:`CacheGeometry.uniform`) with every layer present has
        its shapes fixed by the cache and its token count: its template is found by those two,
        without listing the tensors' shapes (the templates of one cache at a time are kept so);
        a head slice of such a plan by those and its slot, given as ``shaped`` with ``plan`` the
        whole request's (a sliced plan keeps no geometry) and ``shapes_of`` giving the slice's
        plan, asked for only when its template is new."""
        if shaped is None:
            tokens = _uniform_tokens(plan)
            shaped = None if tokens is None else _Shaped(plan.geometry, tokens)
        geometry, by_tokens = self._by_tokens
        if shaped is not None and geometry is shaped.geometry and shaped.key in by_tokens:
            return by_tokens[shaped.key].layout(plan.request_id, plan.block_ids, meta)
        keys, values = (plan if shapes_of is None else shapes_of()).dtype_shapes()
        signature = (tuple(keys), tuple(values))
        template = self._templates.get(signature)
        if template is None:
            template = kv_layout_template(keys, values, align=self.align, checksums=self.checksums)
            if len(self._templates) >= _TEMPLATES_KEPT:
                self._templates.clear()
            self._templates[signature] = template
        if shaped is not None:
            if geometry is not shaped.geometry or len(by_tokens) >= _TEMPLATES_KEPT:
                by_tokens = {}  # another cache's (or too many): dropped, not held alive
                self._by_tokens = (shaped.geometry, by_tokens)
            by_tokens[shaped.key] = template
        return template.layout(plan.request_id, plan.block_ids, meta)

    def _put_reserved(
        self, connector: Any, plan: ExtractionPlan, key: str, meta: dict[str, Any]
    ) -> tuple[bool, int, Any]:
        [reservation] = self._fill_reserved(connector, plan, [(key, meta)])
        return reservation.commit()

    def _put_frames(
        self, connector: Connector, plan: ExtractionPlan, job: KeyJob, meta: dict[str, Any], materialized: dict
    ) -> tuple[bool, int, Any]:
        """Put tensors gathered into fresh memory: as zero-copy frames to a connector that takes
        them (:class:`~kvferry.core.ports.FramesPut`), else as the reference hands a connector
        its payload: one device ``uint8`` tensor when the connector says ``supports_raw_data``
        and the KV is on a device, otherwise one ``bytes`` object."""
        slot = (job.offset_in_shard, job.num_slices)
        if slot not in materialized:  # gather once per head slice, even across retries
            materialized[slot] = plan.materialize()
        keys, values = materialized[slot]
        args = (plan.request_id, keys, values, plan.block_ids, meta)
        options: dict[str, Any] = {"align": self.align, "checksums": self.checksums}
        stages = str(self.from_stage), str(self.to_stage)
        if self._takes_frames(connector):
            encoded = encode_frames(*args, **options)
            return connector.put_frames(*stages, job.key, list(encoded.frames))  # type: ignore[attr-defined]
        data: Any = None
        if getattr(connector, "supports_raw_data", False) is True and any(
            t is not None and t.device.type != "cpu" for t in (*keys, *values)
        ):
            data = encode_device_tensor(*args, **options)
        else:
            data = encode_bytes(*args, **options)
        return connector.put(from_stage=stages[0], to_stage=stages[1], put_key=job.key, data=data)
