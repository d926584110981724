"""Typed configuration of the zmq connector, read once from the registry's config dict.

Every invalid value raises ConfigError naming the key. Sizes are bytes, times seconds.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from typing import Any

import attrs

from kvferry.core.errors import ConfigError
from kvferry.core.validate import check_int, check_seconds

__all__ = [
    "ROLES",
    "TRANSPORTS",
    "DEFAULT_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "CurveConfig",
    "ZmqConfig",
    "generate_curve_config",
    "start_authenticator",
]

ROLES = ("sender", "receiver")
#: Default largest message of a streamed payload, in bytes: small enough that libzmq's
#: per-message receive buffer is served from (and returned to) the heap and stays cache-warm
#: while the receiver copies it out.
DEFAULT_CHUNK_BYTES = 2 << 20
#: Smallest ``chunk_bytes`` (below it the per-message overhead dominates).
MIN_CHUNK_BYTES = 64 << 10
TRANSPORTS = ("tcp", "ipc")
_WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")
_CURVE_KEYS = ("server_public", "server_secret", "client_public", "client_secret")


def _z85_key(name: str, value: Any) -> str:
    from zmq.utils import z85

    if not isinstance(value, str) or len(value) != 40:
        raise ConfigError(f"curve.{name} must be a 40-character z85 string")
    try:
        if len(z85.decode(value)) != 32:
            raise ConfigError(f"curve.{name} is not a 32-byte key")
    except (ValueError, KeyError, IndexError) as exc:
        raise ConfigError(f"curve.{name} is not valid z85: {exc}") from None
    return value


def _check_pair(public: str | None, secret: str | None, who: str) -> None:
    if public is None or secret is None:
        return
    import zmq

    derived = zmq.curve_public(secret.encode("ascii")).decode("ascii")
    if derived != public:
        raise ConfigError(f"curve.{who}_public does not belong to curve.{who}_secret")


@attrs.frozen
class CurveConfig:
    """CURVE keys (z85 text). The sender needs the server pair; a receiver needs
    ``server_public`` and the client pair. ``allowed_clients`` are the client public keys the
    sender admits (default: ``client_public`` when given, else any CURVE client)."""

    server_public: str | None = None
    server_secret: str | None = None
    client_public: str | None = None
    client_secret: str | None = None
    allowed_clients: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, raw: Any) -> CurveConfig:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"curve must be a mapping of z85 keys, got {type(raw).__name__}")
        unknown = set(raw) - set(_CURVE_KEYS) - {"allowed_clients"}
        if unknown:
            raise ConfigError(f"curve has unknown keys {sorted(unknown)}")
        keys = {k: _z85_key(k, raw[k]) for k in _CURVE_KEYS if raw.get(k) is not None}
        allowed_raw = raw.get("allowed_clients") or ()
        if isinstance(allowed_raw, str) or not isinstance(allowed_raw, (list, tuple)):
            raise ConfigError("curve.allowed_clients must be a list of z85 public keys")
        allowed = tuple(_z85_key("allowed_clients[]", k) for k in allowed_raw)
        config = cls(**keys, allowed_clients=allowed)
        _check_pair(config.server_public, config.server_secret, "server")
        _check_pair(config.client_public, config.client_secret, "client")
        return config

    def admitted(self) -> tuple[str, ...]:
        """Client keys the sender admits; empty means any client that completes CURVE."""
        if self.allowed_clients:
            return self.allowed_clients
        return (self.client_public,) if self.client_public else ()

    def require_server(self) -> tuple[str, str]:
        if not (self.server_public and self.server_secret):
            raise ConfigError("curve.server_public and curve.server_secret are required to send")
        return self.server_public, self.server_secret

    def require_client(self) -> tuple[str, str, str]:
        if not (self.server_public and self.client_public and self.client_secret):
            raise ConfigError(
                "curve.server_public, curve.client_public and curve.client_secret are required to receive"
            )
        return self.server_public, self.client_public, self.client_secret


def start_authenticator(context: Any, curve: CurveConfig, log: Any) -> Any:
    """Start a ZAP authenticator on ``context`` that admits ``curve.admitted()`` client keys
    (any CURVE client when that is empty); the caller stops it (``.stop()``)."""
    from zmq.auth import CURVE_ALLOW_ANY
    from zmq.auth.thread import ThreadAuthenticator

    curve.require_server()
    auth = ThreadAuthenticator(context, log=log)
    auth.start()
    admitted = curve.admitted()
    if admitted:
        auth.configure_curve_callback(domain="*", credentials_provider=_KeyList(admitted))
    else:
        auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY)
    return auth


class _KeyList:
    """A ZAP credentials provider admitting a fixed set of z85 client keys."""

    def __init__(self, allowed: tuple[str, ...]) -> None:
        self.allowed = frozenset(k.encode("ascii") for k in allowed)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


def generate_curve_config() -> dict[str, str]:
    """Fresh server and client key pairs as a ``curve`` config dict (z85 text)."""
    import zmq

    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return {
        "server_public": server_public.decode("ascii"),
        "server_secret": server_secret.decode("ascii"),
        "client_public": client_public.decode("ascii"),
        "client_secret": client_secret.decode("ascii"),
    }


def _int(raw: Mapping[str, Any], key: str, default: int, minimum: int, maximum: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return check_int(key, value, minimum, maximum=maximum)


def _seconds(raw: Mapping[str, Any], key: str, default: float) -> float:
    return check_seconds(key, raw.get(key, default))


def _seconds_or_zero(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value == 0 and not isinstance(value, bool):
        return 0.0
    return _seconds(raw, key, default)


def _flag(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _chunk_bytes(raw: Mapping[str, Any]) -> int:
    value = _int(raw, "chunk_bytes", DEFAULT_CHUNK_BYTES, 0)
    if 0 < value < MIN_CHUNK_BYTES:
        raise ConfigError(f"chunk_bytes must be 0 (no streaming) or >= {MIN_CHUNK_BYTES}, got {value}")
    return value


def _choice(raw: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = raw.get(key, default)
    if value not in choices:
        raise ConfigError(f"{key} must be one of {choices}, got {value!r}")
    return value


def _host(raw: Mapping[str, Any], key: str, default: str | None) -> str | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key} must be a non-empty host string, got {value!r}")
    return value.strip()


def _device(raw: Mapping[str, Any]) -> str | None:
    value = raw.get("bind_device")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 15 or "/" in value or value.strip() != value:
        raise ConfigError(f"bind_device must be a network interface name (1..15 characters), got {value!r}")
    return value


_KNOWN = {
    "type",
    "role",
    "transport",
    "host",
    "port",
    "advertise_host",
    "bind_device",
    "ipc_dir",
    "pool_bytes",
    "max_payloads",
    "readers",
    "lease_s",
    "request_timeout_s",
    "max_wait_s",
    "max_parked",
    "sender_host",
    "sender_port",
    "sender_zmq_port",
    "curve",
    "late_stash_bytes",
    "late_stash_s",
    "max_frame_bytes",
    "start_timeout_s",
    "chunk_bytes",
    "prefault",
    "drain_wait_s",
    "recv_pool_bytes",
    "recv_hwm",
    "stream_idle_s",
}


@attrs.frozen
class ZmqConfig:
    """The zmq connector's settings.

    - ``role``: ``"sender"`` binds and serves what it was given; ``"receiver"`` only pulls.
    - ``host``/``port``: where a sender binds (loopback by default; ``port`` 0 with tcp lets
      the OS choose, reported in ``health()`` and put metadata). ``advertise_host`` is the host
      put metadata names (default ``host``; required when ``host`` is a wildcard).
    - ``bind_device``: a sender's listening socket accepts connections only through this
      interface (SO_BINDTODEVICE): binding an address alone does not stop Linux from taking
      connections to it that arrive on another interface (the weak host model).
    - ``transport`` ``"ipc"``: the sender binds ``ipc_path(ipc_dir, port)`` instead.
    - ``pool_bytes``/``max_payloads``: bounds of what a sender holds; ``readers`` gets per
      payload (default 1); ``lease_s``: an unread payload is dropped after this.
    - ``request_timeout_s``: how long a non-blocking ``get`` waits for the sender's answer;
      ``max_wait_s``: the sender caps a "wait" request to this; ``max_parked``: most parked
      "wait" requests.
    - ``sender_host``/``sender_port`` (alias ``sender_zmq_port``): a receiver's default sender.
    - ``late_stash_bytes``/``late_stash_s``: payloads whose reply came after its caller's
      deadline are kept this long (bounded) for the next get of the same key.
    - ``max_frame_bytes``: a receiver refuses a frame larger than this (-1: no limit).
    - ``chunk_bytes``: a sender streams a payload larger than this as messages of at most this
      many bytes (0: never; one message per payload); ``prefault``: touch the whole send pool
      at construction (default: pages are touched on first use and kept); ``drain_wait_s``:
      how long ``put``/``reserve`` wait for sends libzmq still reads before saying pool_full.
    - ``recv_pool_bytes``: a receiver's reused buffer pool for streamed payloads (0: none;
      streamed payloads arrive as frames); ``recv_hwm``: most messages libzmq queues per sender
      before it stops reading (0: no bound); ``stream_idle_s``: a streamed reply that makes no
      progress for this long is dropped.
    """

    role: str = "receiver"
    transport: str = "tcp"
    host: str = "127.0.0.1"
    port: int | None = None
    advertise_host: str | None = None
    bind_device: str | None = None
    ipc_dir: str = attrs.field(factory=tempfile.gettempdir)
    pool_bytes: int = 2 << 30
    max_payloads: int = 4096
    readers: int = 1
    lease_s: float = 300.0
    request_timeout_s: float = 5.0
    max_wait_s: float = 3600.0
    max_parked: int = 4096
    sender_host: str | None = None
    sender_port: int | None = None
    curve: CurveConfig | None = None
    late_stash_bytes: int = 256 << 20
    late_stash_s: float = 60.0
    max_frame_bytes: int = -1
    start_timeout_s: float = 10.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    prefault: bool = False
    drain_wait_s: float = 1.0
    recv_pool_bytes: int = 2 << 30
    recv_hwm: int = 1
    stream_idle_s: float = 30.0
    ignored_keys: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> ZmqConfig:
        """Validate a config dict (unknown keys are listed in ``ignored_keys``)."""
        raw = dict(raw or {})
        role = _choice(raw, "role", "receiver", ROLES)
        transport = _choice(raw, "transport", "tcp", TRANSPORTS)
        host = _host(raw, "host", "127.0.0.1")
        port = None
        if role == "sender" or raw.get("port") is not None:
            if "port" not in raw:
                raise ConfigError("port is required for role 'sender' (0 lets the OS choose)")
            port = _int(raw, "port", 0, 1 if transport == "ipc" else 0, 65535)
        advertise = _host(raw, "advertise_host", None)
        if role == "sender" and advertise is None:
            if host in _WILDCARD_HOSTS and transport == "tcp":
                raise ConfigError(f"advertise_host is required when host is {host!r}")
            advertise = host
        ipc_dir = raw.get("ipc_dir", tempfile.gettempdir())
        if not isinstance(ipc_dir, str) or not ipc_dir.startswith("/"):
            raise ConfigError(f"ipc_dir must be an absolute directory path, got {ipc_dir!r}")
        sender_port = raw.get("sender_port", raw.get("sender_zmq_port"))
        if sender_port is not None:
            sender_port = _int({"sender_port": sender_port}, "sender_port", 0, 1, 65535)
        curve = raw.get("curve")
        max_frame = raw.get("max_frame_bytes", -1)
        if max_frame != -1:
            max_frame = _int(raw, "max_frame_bytes", -1, 1)
        return cls(
            role=role,
            transport=transport,
            host=host or "127.0.0.1",
            port=port,
            advertise_host=advertise,
            bind_device=_device(raw),
            ipc_dir=ipc_dir,
            pool_bytes=_int(raw, "pool_bytes", 2 << 30, 1),
            max_payloads=_int(raw, "max_payloads", 4096, 1),
            readers=_int(raw, "readers", 1, 1),
            lease_s=_seconds(raw, "lease_s", 300.0),
            request_timeout_s=_seconds(raw, "request_timeout_s", 5.0),
            max_wait_s=_seconds(raw, "max_wait_s", 3600.0),
            max_parked=_int(raw, "max_parked", 4096, 1),
            sender_host=_host(raw, "sender_host", None),
            sender_port=sender_port,
            curve=CurveConfig.from_mapping(curve) if curve is not None else None,
            late_stash_bytes=_int(raw, "late_stash_bytes", 256 << 20, 0),
            late_stash_s=_seconds(raw, "late_stash_s", 60.0),
            max_frame_bytes=max_frame,
            start_timeout_s=_seconds(raw, "start_timeout_s", 10.0),
            chunk_bytes=_chunk_bytes(raw),
            prefault=_flag(raw, "prefault", False),
            drain_wait_s=_seconds_or_zero(raw, "drain_wait_s", 1.0),
            recv_pool_bytes=_int(raw, "recv_pool_bytes", 2 << 30, 0),
            recv_hwm=_int(raw, "recv_hwm", 1, 0),
            stream_idle_s=_seconds(raw, "stream_idle_s", 30.0),
            ignored_keys=tuple(sorted(set(raw) - _KNOWN)),
        )
