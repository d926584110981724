"""A sender process extracts requests from a paged cache of each layout (SPEC 4); a receiver in
another process (this one) gets bit-identical tensors over shm and over zmq."""

from __future__ import annotations

import pathlib

import pytest
import torch
from layout_worker import blocks

from kvferry.app.wiring import build_manager

HERE = pathlib.Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
@pytest.mark.parametrize("connector", ["shm", "zmq"])
def test_every_layout_arrives_bit_exact_in_another_process(connector, itkit, tmp_path, shm_namespace) -> None:
    reference = blocks(7)
    requests = [("r-a", [5, 1, 9, 20], 61), ("r-b", [3], 7), ("r-c", [0, 1, 2, 23, 22], 80)]
    for layout in ("flash", "flashinfer", "packed", "tuple"):
        base = itkit.free_base_port(1)
        worker = itkit.LineWorker(
            [connector, str(base), layout, shm_namespace], tmp_path / f"{layout}.log", script=HERE / "layout_worker.py"
        )
        try:
            port = worker.read()["ready"]
            cfg = {"type": connector, "zmq_port": base}
            if connector == "shm":
                cfg["namespace"] = shm_namespace
            receiver = build_manager(
                {
                    "connector_config": cfg,
                    "stage_id": 1,
                    "engine_input_source": [0],
                    "need_recv_cache": True,
                    "recv_timeout": 30,
                },
                env={},
            )
            try:
                for rid, block_ids, seq_len in requests:
                    rid = f"{layout}-{rid}"
                    sent = worker.ask({"op": "send", "request_id": rid, "block_ids": block_ids, "seq_len": seq_len})
                    assert sent["ok"], sent
                    result = receiver.receive(rid, sender_info={"host": "127.0.0.1", "zmq_port": port})
                    assert result.ok, result.outcome
                    kv = result.payload["layer_blocks"]
                    assert result.payload["metadata"]["seq_len"] == seq_len
                    for layer, (k, v) in enumerate(reference):
                        want_k = k[block_ids].reshape(-1, *k.shape[2:])[:seq_len]
                        want_v = v[block_ids].reshape(-1, *v.shape[2:])[:seq_len]
                        got_k, got_v = kv["key_cache"][layer], kv["value_cache"][layer]
                        assert got_k.dtype == torch.bfloat16 and got_k.shape == want_k.shape, (layout, layer)
                        assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16)), (layout, rid, layer)
                        assert torch.equal(got_v.view(torch.int16), want_v.view(torch.int16)), (layout, rid, layer)
            finally:
                receiver.close()
            assert worker.finish() == 0
        finally:
            worker.kill_quietly()
