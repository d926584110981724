"""The sender's side of a refusal: the log line, the fix to name, and the markers it puts.

A request the send path cannot send is never dropped in silence (issue 22): the refusal is an
error in the log naming the request, the cache shape and the fix; a FAILED
:class:`~kvferry.core.outcomes.SendOutcome` whose ``refusal_keys`` say where markers went; and
a refusal marker (:mod:`kvferry.core.refusal`, docs/wire-format.md) under each of the request's
keys, so a kvferry receiver ends its wait at once instead of after ``recv_timeout``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvferry.adapters.kv_layouts import AmbiguousLayout
from kvferry.adapters.torch_frames import encode_bytes
from kvferry.core.errors import KVFerryError
from kvferry.core.outcomes import SendOutcome, SendReason
from kvferry.core.ports import Connector, FramesPut
from kvferry.core.refusal import Refusal

__all__ = ["cache_shape", "fix_for", "marker_payload", "put_markers", "refuse"]

logger = logging.getLogger(__name__)

#: A marker names at most this many layers (all absent); more is no cache an engine hands over.
_MAX_MARKER_LAYERS = 4096


def _shape_of(layer: Any) -> str:
    shape = getattr(layer, "shape", None)
    if shape is not None:
        return f"{list(shape)} {str(getattr(layer, 'dtype', '')).removeprefix('torch.')}".strip()
    if isinstance(layer, (tuple, list)):
        return "(" + ", ".join(_shape_of(x) for x in layer) + ")"
    return type(layer).__name__


def cache_shape(kv_caches: Any) -> str:
    """What the engine handed over, for the log: ``"28 layers of [4, 2, 128, 128] bfloat16"``."""
    if isinstance(kv_caches, Mapping):
        kv_caches = list(kv_caches.values())
    if not isinstance(kv_caches, Sequence) or isinstance(kv_caches, (str, bytes)):
        return f"a {type(kv_caches).__name__}, not a list of layers"
    if not kv_caches:
        return "no layers"
    shapes = {_shape_of(layer) for layer in kv_caches}
    first = _shape_of(kv_caches[0])
    others = "" if len(shapes) == 1 else f" (and {len(shapes) - 1} other shapes)"
    return f"{len(kv_caches)} layer{'' if len(kv_caches) == 1 else 's'} of {first}{others}"


def fix_for(reason: SendReason, error: BaseException | None = None) -> str:
    """What the operator changes, for a refusal of ``reason`` (caused by ``error``)."""
    if isinstance(error, AmbiguousLayout):
        names = ", ".join(repr(c) for c in error.candidates) or "the cache's layout"
        return (
            f"name the layout: omni_kv_config.kv_layout = one of {names} (vLLM's CPU cache is 'vllm_cpu', "
            f"FlashAttention's on GPU 'flash'; docs/layouts.md)"
        )
    if error is not None and reason is SendReason.ERROR:
        return "check omni_kv_config.kv_layout and the cache the engine hands over against docs/layouts.md"
    return {
        SendReason.NO_BLOCKS: "the engine handed the request over without block ids: check its hand-off",
        SendReason.NO_PAYLOAD: (
            "every layer came out empty: name the cache's layout (omni_kv_config.kv_layout, docs/layouts.md) "
            "and check seq_len"
        ),
        SendReason.POOL_FULL: "raise connector_config.pool_bytes, or let receivers keep up (they free what they read)",
        SendReason.PUT_FAILED: "check the connector (connector_config) and that the receiving stage is up",
    }.get(reason, "see the detail")


def marker_payload(request_id: str, num_layers: int, refusal: Refusal, *, align: int = 64) -> bytes:
    """The refusal marker of one request: a header only, ``num_layers`` absent layers."""
    n = max(0, min(int(num_layers), _MAX_MARKER_LAYERS))
    return encode_bytes(request_id, [None] * n, [None] * n, [], refusal.metadata(), align=align)


def put_markers(connector: Connector, from_stage: str, to_stage: str, keys: Sequence[str], marker: bytes) -> list[str]:
    """Put ``marker`` under each key (one try each: it is small, and a failure here must not
    hide the refusal); the keys it went under."""
    done: list[str] = []
    for key in keys:
        try:
            if isinstance(connector, FramesPut):
                ok, _, _ = connector.put_frames(from_stage, to_stage, key, [marker])
            else:
                ok, _, _ = connector.put(from_stage=from_stage, to_stage=to_stage, put_key=key, data=marker)
        except Exception as exc:  # a foreign connector's fault: the refusal stands without this key
            logger.warning("refusal marker under %r not put: %s: %s", key, type(exc).__name__, exc)
            continue
        if ok:
            done.append(key)
    return done


def refuse(
    path: Any,
    connector: Connector,
    request_id: str,
    kv_caches: Any,
    reason: SendReason,
    detail: str,
    error: BaseException | None = None,
    *,
    keys: Sequence[str] | None = None,
    failed_keys: Sequence[str] = (),
    nbytes: int = 0,
    sent_keys: Sequence[str] = (),
    attempts: int = 0,
    seconds: float = 0.0,
) -> SendOutcome:
    """A request ``path`` (a :class:`~kvferry.app.send.SendPath`) does not (wholly) send: an
    error in the log naming the request, the cache shape and the fix; a refusal marker under
    each of ``keys`` (default: every key of the request), so the receiving stage learns of it at
    once; the FAILED outcome (``refusal_keys``: where the markers went)."""
    shape = cache_shape(kv_caches)
    fix = fix_for(reason, error)
    if keys is None:
        try:
            keys = [job.key for job in path.jobs(request_id)]
        except KVFerryError:
            keys = []
    refusal = Refusal(reason.value, f"request {request_id}: {detail} (cache: {shape})", fix)
    layers = len(kv_caches) if isinstance(kv_caches, (Sequence, Mapping)) else 0
    marker = marker_payload(request_id, layers, refusal, align=path.align)
    told = put_markers(connector, str(path.from_stage), str(path.to_stage), keys, marker)
    logger.error(
        "request %s: KV not sent (%s): %s; cache: %s; fix: %s; the receiving stage was told under %d of %d keys",
        request_id,
        reason.value,
        detail,
        shape,
        fix,
        len(told),
        len(keys),
    )
    return SendOutcome.failed(
        request_id,
        reason,
        f"{detail}; cache: {shape}; fix: {fix}",
        nbytes=nbytes,
        keys=sent_keys,
        failed_keys=failed_keys,
        attempts=attempts,
        seconds=seconds,
        refusal_keys=told,
    )
