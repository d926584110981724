"""Fuzz target for kvferry's decoders: the KV payload codec (SPEC 3.1) and side payloads (3.2).

``fuzz_one(data)`` feeds one input to every decoder a remote peer can reach, in several
containers (bytes, frames split at a data-chosen point, a uint8 tensor), and raises
``AssertionError`` when anything but :class:`~kvferry.core.errors.PayloadError` escapes, or
when an accepted payload hands out tensors that are not inside the input.

Run standalone (atheris when installed, else the deterministic mutation loop)::

    python tests/reliability/fuzz_target.py [N]
    python tests/reliability/fuzz_target.py --shard N SEED   # N inputs of the loop, verdict as JSON
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import torch

from kvferry.adapters.side_codec import unpack_request_kv
from kvferry.adapters.torch_frames import DecodedKV, decode_payload
from kvferry.core.errors import PayloadError

__all__ = ["Verdict", "fuzz_one", "decode_kv", "decode_side", "run_loop"]


class Verdict:
    """Counts of what the decoders did with the inputs so far."""

    def __init__(self) -> None:
        self.accepted = 0
        self.rejected = 0
        self.misses = 0  # side payloads saying "the sender failed"
        self.inputs = 0

    def as_dict(self) -> dict[str, int]:
        return {"inputs": self.inputs, "accepted": self.accepted, "rejected": self.rejected, "misses": self.misses}


def _tensors(kv: DecodedKV) -> list[torch.Tensor]:
    return [t for t in (*kv.key_cache, *kv.value_cache) if t is not None]


def _check_inside(kv: DecodedKV, size: int) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(kv))
    assert nbytes <= size, f"decoded tensors hold {nbytes} bytes from a {size}-byte input"
    assert kv.nbytes == size, (kv.nbytes, size)


def _container(data: bytes, how: int) -> Any:
    if how == 0 or len(data) < 2:
        return data
    if how == 1:
        cut = data[0] % len(data)
        return [memoryview(data)[:cut], memoryview(data)[cut:]]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def decode_kv(data: bytes, verdict: Verdict, how: int = 0) -> None:
    """One KV-payload decode; only PayloadError may escape the library."""
    try:
        kv = decode_payload(_container(data, how))
    except PayloadError:
        verdict.rejected += 1
        return
    except Exception as exc:  # the finding: anything else is a defect
        raise AssertionError(f"decode_payload raised {type(exc).__name__}: {exc} on {data[:120]!r}") from exc
    verdict.accepted += 1
    _check_inside(kv, len(data))


def decode_side(data: bytes, verdict: Verdict, how: int = 0) -> None:
    """One side-payload unpack; a miss (sender failed) is a value, anything else PayloadError."""
    try:
        fields = unpack_request_kv(_container(data, how))
    except PayloadError:
        verdict.rejected += 1
        return
    except Exception as exc:
        raise AssertionError(f"unpack_request_kv raised {type(exc).__name__}: {exc} on {data[:120]!r}") from exc
    if fields is None:
        verdict.misses += 1
    else:
        verdict.accepted += 1
        assert isinstance(fields, dict)


def fuzz_one(data: bytes, verdict: Verdict | None = None) -> None:
    """Every decoder, every container, on one input."""
    verdict = verdict if verdict is not None else Verdict()
    verdict.inputs += 1
    how = data[-1] % 3 if data else 0
    decode_kv(data, verdict, how)
    decode_side(data, verdict, how)


def run_loop(count: int, seed: int = 1) -> tuple[Verdict, float]:
    """The deterministic mutation loop over the seed corpus: ``count`` inputs."""
    from fuzz_corpus import build_seeds, build_side_seeds, mutate

    kv = [s.raw for s in build_seeds()]
    side = [s.raw for s in build_side_seeds()]
    rng = random.Random(seed)
    verdict = Verdict()
    started = time.monotonic()
    for i in range(count):
        verdict.inputs += 1
        if i % 5 == 4:
            decode_side(mutate(rng, rng.choice(side), side), verdict, i % 3)
        else:
            decode_kv(mutate(rng, rng.choice(kv), kv), verdict, i % 3)
    return verdict, time.monotonic() - started


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "--shard":  # one shard of the test's loop: its verdict as JSON
        verdict, seconds = run_loop(int(argv[2]), seed=int(argv[3]))
        print(json.dumps({**verdict.as_dict(), "seconds": seconds}))
        return 0
    count = int(argv[1]) if len(argv) > 1 else 100_000
    try:
        import atheris  # optional coverage-guided fuzzing
    except ImportError:
        verdict, seconds = run_loop(count)
        print(
            f"{verdict.as_dict()} in {seconds:.1f} s (deterministic loop; install atheris for coverage-guided fuzzing)"
        )
        return 0
    atheris.Setup(argv, lambda data: fuzz_one(bytes(data)))
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    raise SystemExit(main(sys.argv))
