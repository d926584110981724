"""What the vLLM connector reads: its extra config and a request's ``kv_transfer_params``.

Pure values, no vLLM and no torch, so a proxy (or a test) can build and check the hand-off
without an engine. Every error is a :class:`~kvferry.core.errors.ConfigError` whose message
starts with the field at fault (``kv_transfer_params.remote_port: ...``).

The hand-off (docs/vllm.md):

- the prefill instance gets ``{"do_remote_decode": true}`` (optionally ``transfer_id``,
  ``decode_tp_size`` and ``decode_block_size``) and returns :func:`prefill_result` in
  ``RequestOutput.kv_transfer_params``;
- a proxy passes that dict unchanged as the decode request's ``kv_transfer_params``; the decode
  instance reads it with :func:`parse_decode_params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.app.registry import connector_role_config
from kvferry.core.addressing import get_metadata, kv_port
from kvferry.core.errors import ConfigError
from kvferry.core.validate import check_int

__all__ = [
    "PARAMS_VERSION",
    "LOAD_MODES",
    "HUGE_PAGE_MODES",
    "RECOMPUTE_THRESHOLD",
    "ConnectorSettings",
    "PrefillRequest",
    "recompute_instead",
    "DecodeSource",
    "parse_prefill_params",
    "parse_decode_params",
    "prefill_result",
]

#: Version of the hand-off dict (``kvferry_version``); a decode instance refuses others.
PARAMS_VERSION = 1
_FIELD = "kv_transfer_params"
_EXTRA = "kv_connector_extra_config"
#: ``huge_pages`` settings: collapse the host cache onto huge pages at registration, advise
#: the kernel to (khugepaged in the background), or leave it alone.
HUGE_PAGE_MODES = ("collapse", "advise", "off")


def _int(where: str, name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    bound = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}"
    return check_int(f"{where}.{name}:", value, minimum, maximum=maximum, expected=bound)


def _seconds(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{where}.{name}: expected a number of seconds > 0, got {value!r}")
    return float(value)


#: How a decode instance loads a request's KV (ConnectorSettings.load_mode).
LOAD_MODES = ("async", "sync")


def _load_mode(where: str, value: Any) -> str:
    if value not in LOAD_MODES:
        raise ConfigError(f"{where}.load_mode: expected one of {', '.join(LOAD_MODES)}, got {value!r}")
    return str(value)


#: Default ``kv_recompute_threshold`` (prompt tokens): measured with ``kvferry bench --engine vllm``
#: (tiny 8-layer model, 2 cores): the decode computing the prompt itself (12-18 ms at 128-512
#: tokens, 31-32 ms at 1024) against the async shm load (18-23 ms at every length) crosses at about
#: 700 tokens (docs/vllm.md, "Short prompts"). A real model computes a token hundreds of times
#: slower for tens of times more KV bytes: there the crossing is far lower; measure it and set it.
RECOMPUTE_THRESHOLD = 768


def recompute_instead(num_tokens: int, threshold: int) -> bool:
    """Whether a hand-off of ``num_tokens`` prompt tokens is skipped for a recompute by the
    decode instance (``kv_recompute_threshold``; 0: never). The one rule both sides apply: the
    prefill then saves nothing, the decode loads nothing."""
    return threshold > 0 and num_tokens < threshold


def _str(where: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.{name}: expected a non-empty string, got {value!r}")
    return value


@attrs.frozen
class ConnectorSettings:
    """The connector's options, from ``kv_connector_extra_config`` (all optional).

    ``connector``: a kvferry connector config (``{"type": "zmq", ...}``; default shm, same
    host). ``base_port``: SPEC 2.3 base; the prefill rank's sender port is derived from it.
    ``host``: where a zmq sender binds and what it advertises (loopback by default).
    ``load_timeout_s``: how long the decode side waits for each layer before the load fails
    (then ``kv_load_failure_policy`` applies). ``lease_s``: how long an unread layer stays in
    the prefill's pool. ``pool_bytes``: the prefill's pool. ``checksums``: a payload checksum
    algorithm (``crc32c``, ``crc32``) or None. ``decode_tp_size``: the decode instance's TP size the prefill
    slices heads for (a request may override it). ``decode_block_size``: the decode instance's
    block size a hybrid prefill sends a sliding window's pages for (groups.window_first_page;
    a request may override it; None: the prefill's own). ``load_threads``: concurrent loads.
    ``inline_load_s``: how long a load first runs in the engine's own thread, reading what is
    there already, before the rest waits on a load thread (0: every load on a load thread).
    ``load_mode``: ``"async"`` (a request waits for its KV, up to ``load_timeout_s``) or
    ``"sync"`` (the request runs in the step its KV is asked for: the KV must be there within
    ``inline_load_s``, or the prompt is recomputed as after any failed load); a request's
    ``kv_transfer_params.load_mode`` overrides it. ``idle_wait_s``: in a step that runs no
    tokens while this rank has saves or loads in flight, how long the engine's thread waits
    for one of them to end (on an event, so it returns as soon as one does) instead of going
    straight on to the next empty step (0: never waits); see docs/vllm.md.
    ``kv_recompute_threshold``: prompts of fewer tokens are not handed off: the prefill saves
    nothing for them and the decode computes them itself (:func:`recompute_instead`; 0: every
    prompt is handed off). Set the same value on both sides.
    ``in_place``: over a connector that reads payloads in place (nixl: the PiecesPut ability),
    a prefill registers its KV cache with it and a decode reads the pages straight from the
    prefill's cache: only each payload's header is copied into the pool, and the request's
    blocks stay held until every payload of its was read or its lease passed. Used where the
    pages can be read so (a host cache in vLLM's CPU layout, one KV cache group, a request
    that ends in the step its prefill completes); a gather into the pool otherwise. False:
    always the gather.
    ``huge_pages``: a host KV cache is moved onto transparent huge pages when the connector
    registers it (:func:`kvferry.adapters.platform.advise_huge_pages`): ``"collapse"`` at once
    (seconds per GB at engine start), ``"advise"`` by the kernel in the background, ``"off"``
    not at all. Extraction and loads touch a request's blocks scattered over the cache; on
    4 KiB pages each block starts with page-table walks. A device cache is left alone.
    """

    connector: Mapping[str, Any] = attrs.field(factory=lambda: {"type": "shm"})
    base_port: int = 50051
    host: str = "127.0.0.1"
    from_stage: int = 0
    to_stage: int = 1
    load_timeout_s: float = 30.0
    lease_s: float = 60.0
    pool_bytes: int = 256 << 20
    checksums: str | None = "crc32c"
    decode_tp_size: int | None = None
    decode_block_size: int | None = None
    load_threads: int = 2
    inline_load_s: float = 0.02
    load_mode: str = "async"
    idle_wait_s: float = 0.002
    kv_recompute_threshold: int = RECOMPUTE_THRESHOLD
    in_place: bool = True
    huge_pages: str = "collapse"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Read ``kv_connector_extra_config``; unknown keys are an error naming them."""
        extra = dict(extra or {})
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ConfigError(f"{_EXTRA}.{unknown[0]}: unknown option (known: {', '.join(sorted(known))})")
        out: dict[str, Any] = {}
        if "connector" in extra:
            conn = extra["connector"]
            if not isinstance(conn, Mapping) or not isinstance(conn.get("type"), str):
                raise ConfigError(f"{_EXTRA}.connector: expected a dict with a 'type', got {conn!r}")
            out["connector"] = dict(conn)
        for name in ("base_port",):
            if name in extra:
                out[name] = _int(_EXTRA, name, extra[name], 1, 65535)
        for name in ("from_stage", "to_stage"):
            if name in extra:
                out[name] = _int(_EXTRA, name, extra[name], 0, 15)
        for name in ("load_timeout_s", "lease_s"):
            if name in extra:
                out[name] = _seconds(_EXTRA, name, extra[name])
        for name in ("inline_load_s", "idle_wait_s"):
            if name in extra:
                value = extra[name]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                    raise ConfigError(f"{_EXTRA}.{name}: expected seconds in 0..1, got {value!r}")
                out[name] = float(value)
        if "load_mode" in extra:
            out["load_mode"] = _load_mode(_EXTRA, extra["load_mode"])
        if "pool_bytes" in extra:
            out["pool_bytes"] = _int(_EXTRA, "pool_bytes", extra["pool_bytes"], 1 << 16)
        if "kv_recompute_threshold" in extra:
            out["kv_recompute_threshold"] = _int(_EXTRA, "kv_recompute_threshold", extra["kv_recompute_threshold"], 0)
        if "load_threads" in extra:
            out["load_threads"] = _int(_EXTRA, "load_threads", extra["load_threads"], 1, 64)
        for name in ("decode_tp_size", "decode_block_size"):
            if name in extra and extra[name] is not None:
                out[name] = _int(_EXTRA, name, extra[name], 1)
        if "host" in extra:
            out["host"] = _str(_EXTRA, "host", extra["host"])
        if "in_place" in extra:
            if not isinstance(extra["in_place"], bool):
                raise ConfigError(f"{_EXTRA}.in_place: expected true or false, got {extra['in_place']!r}")
            out["in_place"] = extra["in_place"]
        if "huge_pages" in extra:
            if extra["huge_pages"] not in HUGE_PAGE_MODES:
                raise ConfigError(
                    f"{_EXTRA}.huge_pages: expected one of {', '.join(HUGE_PAGE_MODES)}, got {extra['huge_pages']!r}"
                )
            out["huge_pages"] = extra["huge_pages"]
        if "checksums" in extra:
            value = extra["checksums"]
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{_EXTRA}.checksums: expected an algorithm name or null, got {value!r}")
            out["checksums"] = value
        return cls(**out)

    @property
    def connector_type(self) -> str:
        return str(self.connector.get("type"))

    def sender_port(self, tp_rank: int, tp_size: int) -> int:
        """The prefill rank's port (SPEC 2.3); rank ``r``'s is rank 0's ``+ r * 16``."""
        return kv_port(self.base_port, self.from_stage, tp_rank, 0, 0, tp_size=tp_size)

    def sender_config(self, tp_rank: int, tp_size: int) -> dict[str, Any]:
        """The kvferry connector config of a prefill rank (role sender; the one rule,
        :func:`kvferry.app.registry.connector_role_config`)."""
        cfg = dict(self.connector)
        cfg.setdefault("pool_bytes", self.pool_bytes)
        cfg.setdefault("lease_s", self.lease_s)
        return connector_role_config(cfg, role="sender", sender_port=self.sender_port(tp_rank, tp_size), host=self.host)

    def receiver_config(self) -> dict[str, Any]:
        """The kvferry connector config of a decode rank (role receiver)."""
        return connector_role_config(self.connector, role="receiver", sender_port=None, host=self.host)


@attrs.frozen
class PrefillRequest:
    """What the prefill instance reads from a request's ``kv_transfer_params``."""

    transfer_id: str | None
    decode_tp_size: int | None
    #: The decode's block size (a hybrid prefill's sliding-window pages are sent for it).
    decode_block_size: int | None = None


def parse_prefill_params(params: Any) -> PrefillRequest | None:
    """None when the request is not a remote-decode one (no ``do_remote_decode``)."""
    if not isinstance(params, Mapping) or not params.get("do_remote_decode"):
        return None
    tid = params.get("transfer_id")
    if tid is not None:
        tid = _str(_FIELD, "transfer_id", tid)
        if "/" in tid or "\x00" in tid:
            raise ConfigError(f"{_FIELD}.transfer_id: must not contain '/' or NUL, got {tid!r}")
    tp = params.get("decode_tp_size")
    if tp is not None:
        tp = _int(_FIELD, "decode_tp_size", tp, 1)
    bs = params.get("decode_block_size")
    if bs is not None:
        bs = _int(_FIELD, "decode_block_size", bs, 1)
    return PrefillRequest(tid, tp, bs)


@attrs.frozen
class DecodeSource:
    """Where the decode side pulls a request's KV from, and what it expects."""

    transfer_id: str
    host: str
    port: int
    num_tokens: int
    block_size: int
    num_layers: int
    prefill_tp_size: int
    decode_tp_size: int
    connector_type: str
    engine_id: str
    #: The request's own ``load_mode`` (None: the instance's).
    load_mode: str | None = None

    def source_metadata(self, from_rank: int) -> dict[str, Any]:
        """The partial connector metadata of prefill rank ``from_rank`` (SPEC 2.3 port)."""
        metadata = get_metadata(self.host, self.port, from_rank, request_scoped=True)
        assert metadata is not None  # a host and a port, request-scoped: always named
        return metadata


_DECODE_FIELDS = (
    "transfer_id",
    "remote_host",
    "remote_port",
    "remote_num_tokens",
    "remote_block_size",
    "remote_num_layers",
    "remote_tp_size",
    "decode_tp_size",
    "kvferry_connector",
)


def parse_decode_params(params: Any) -> DecodeSource | None:
    """None unless ``do_remote_prefill`` is set; otherwise the checked source, or ConfigError
    naming the first missing or malformed field."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise ConfigError(f"{_FIELD}: expected a dict, got {type(params).__name__}")
    if not params.get("do_remote_prefill"):
        return None
    version = params.get("kvferry_version")
    if version != PARAMS_VERSION:
        raise ConfigError(
            f"{_FIELD}.kvferry_version: expected {PARAMS_VERSION} (params made by kvferry's "
            f"prefill side), got {version!r}"
        )
    for name in _DECODE_FIELDS:
        if name not in params:
            raise ConfigError(f"{_FIELD}.{name}: missing")
    return DecodeSource(
        transfer_id=_str(_FIELD, "transfer_id", params["transfer_id"]),
        host=_str(_FIELD, "remote_host", params["remote_host"]),
        port=_int(_FIELD, "remote_port", params["remote_port"], 1, 65535),
        num_tokens=_int(_FIELD, "remote_num_tokens", params["remote_num_tokens"], 1),
        block_size=_int(_FIELD, "remote_block_size", params["remote_block_size"], 1),
        num_layers=_int(_FIELD, "remote_num_layers", params["remote_num_layers"], 1),
        prefill_tp_size=_int(_FIELD, "remote_tp_size", params["remote_tp_size"], 1),
        decode_tp_size=_int(_FIELD, "decode_tp_size", params["decode_tp_size"], 1),
        connector_type=_str(_FIELD, "kvferry_connector", params["kvferry_connector"]),
        engine_id=str(params.get("remote_engine_id", "")),
        load_mode=None if params.get("load_mode") is None else _load_mode(_FIELD, params["load_mode"]),
    )


def prefill_result(
    *,
    transfer_id: str,
    host: str,
    port: int,
    num_tokens: int,
    block_size: int,
    num_layers: int,
    tp_size: int,
    decode_tp_size: int,
    connector_type: str,
    engine_id: str,
) -> dict[str, Any]:
    """The dict the prefill instance returns (``RequestOutput.kv_transfer_params``): exactly
    what the decode request's ``kv_transfer_params`` must be."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvferry_version": PARAMS_VERSION,
        "transfer_id": transfer_id,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
        "remote_block_size": block_size,
        "remote_num_layers": num_layers,
        "remote_tp_size": tp_size,
        "decode_tp_size": decode_tp_size,
        "kvferry_connector": connector_type,
    }
