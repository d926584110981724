"""The vLLM instance server's loop (``kvferry.app.demo.vllm_instance.serve``) without vLLM: a
stand-in engine answers, so the loop's own rules are checked here (ready line, ops added by a
caller, errors answered and the loop going on, ``exit``)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from kvferry.app.demo import vllm_instance


class _Engine:
    llm_engine = None  # no vllm_config: no connector, engine_id null

    def get_metrics(self) -> list[Any]:
        return []


def _serve(monkeypatch: pytest.MonkeyPatch, lines: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    engines: list[_Engine] = []
    monkeypatch.setattr(vllm_instance, "build_llm", lambda cfg: engines.append(_Engine()) or engines[-1])
    out = io.StringIO()
    vllm_instance.serve({"model": "m"}, out, lines=[json.dumps(m) for m in lines], **kw)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_ready_then_ops_added_by_the_caller_errors_and_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def more(llm: Any) -> dict[str, vllm_instance.Op]:
        seen.append(llm)
        return {"echo": lambda llm, m: {"echo": m["x"], "same": llm is seen[0]}, "boom": lambda llm, m: 1 / 0}

    replies = _serve(
        monkeypatch,
        [{"op": "echo", "x": 3}, {"op": "nope"}, {"op": "boom"}, {"op": "metrics"}, {"op": "exit"}, {"op": "echo"}],
        more_ops=more,
    )
    ready, echo, unknown, boom, metrics, bye = replies  # nothing after exit is answered
    assert ready["ok"] and ready["ready"] and ready["engine_id"] is None and ready["startup_s"] >= 0
    assert echo == {"ok": True, "echo": 3, "same": True}
    assert unknown == {"ok": False, "error": "unknown op 'nope'"}
    assert boom["ok"] is False and boom["error"].startswith("ZeroDivisionError")
    assert metrics == {"ok": True, "metrics": {}}
    assert bye == {"ok": True}


def test_without_more_ops_a_test_op_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reply, _ = _serve(monkeypatch, [{"op": "echo"}, {"op": "exit"}])
    assert reply == {"ok": False, "error": "unknown op 'echo'"}
