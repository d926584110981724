"""The one wake-up of the serving connectors' loops: any thread pokes, the loop thread drains.

:class:`Waker` is a non-blocking OS pipe whose read end the loop registers with its
``zmq.Poller``. Poking is safe from any thread (and never blocks: a full pipe already means "wake
up"), so producers never touch the loop's sockets, which stay owned by the loop thread alone.
:class:`Doorbell` adds the keys published since the loop last looked: a put rings it with its key,
the loop takes the keys and serves the gets parked on them (:class:`kvferry.core.parked.ParkedTable`).
The zmq, shm and mooncake senders use these two; the zmq receiver's loop uses the Waker.
"""

from __future__ import annotations

import collections
import os

import attrs

__all__ = ["Doorbell", "Waker"]


@attrs.define(eq=False)
class Waker:
    """``fileno`` is the readable end to poll; ``poke`` wakes; ``drain`` clears; ``close``
    is idempotent."""

    _read_fd: int = -1
    _write_fd: int = -1

    @classmethod
    def create(cls) -> Waker:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        return cls(read_fd, write_fd)

    @property
    def fileno(self) -> int:
        return self._read_fd

    def poke(self) -> None:
        """Wake the loop. Never blocks; a no-op once closed."""
        if self._write_fd < 0:
            return
        try:
            os.write(self._write_fd, b"\x01")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is already pending
        except OSError:
            pass  # closed concurrently during shutdown: nobody is left to wake

    def drain(self) -> None:
        """Consume pending pokes (loop thread only)."""
        while self._read_fd >= 0:
            try:
                if not os.read(self._read_fd, 4096):
                    return
            except BlockingIOError:
                return

    def close(self) -> None:
        for name in ("_write_fd", "_read_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)


@attrs.define(eq=False)
class Doorbell:
    """Keys published since the loop last looked, and the :class:`Waker` that tells it.

    ``ring(key)`` from any thread (never blocks); the loop polls ``fileno`` and calls ``take()``.
    """

    waker: Waker = attrs.field(factory=Waker.create)
    _keys: collections.deque[str] = attrs.field(init=False, factory=collections.deque)

    @property
    def fileno(self) -> int:
        return self.waker.fileno

    def ring(self, key: str | None = None) -> None:
        """Wake the loop; with ``key``, that key was published (serve its parked gets)."""
        if key is not None:
            self._keys.append(key)
        self.waker.poke()

    def take(self) -> list[str]:
        """Drain the pokes and return the keys rung since the last call, in order (loop thread)."""
        self.waker.drain()
        keys = []
        while self._keys:
            keys.append(self._keys.popleft())
        return keys

    def close(self) -> None:
        self.waker.close()
