"""How every connector's control channel reports a frame it cannot read: a value, not a raise.

Each serving connector (zmq, shm, mooncake) decodes its control frames with one function that
returns either a typed message (an attrs value of that connector's protocol) or a
:class:`Rejection`; decoding never raises, whatever the bytes. The serving loop answers a
rejection with an error reply when it can tell whom to answer (``corr_id``), counts it, and goes
on; a receiver that reads a rejected reply treats it as a failed exchange.
"""

from __future__ import annotations

import attrs

__all__ = ["Rejection"]


@attrs.frozen
class Rejection:
    """Why a control frame was not understood: ``reason`` (a short word, such as ``bad_request``),
    ``detail`` (for the log) and ``corr_id``, the request id when it could still be read."""

    reason: str
    detail: str
    corr_id: int | None = None
