"""Prefill TP 1 -> decode TP 2 (gloo on CPU), checked page by page: each decode rank's pages
of a loaded request equal the prefill's pages of that rank's heads (TP 1 and TP 2 instances of
a random tiny model diverge in tokens after a few steps, so tokens are not compared). Over shm
(gathered into the prefill's pool) and over nixl (each decode rank reads its head's pages in
place from the prefill's cache); the nixl case needs nixl in the vLLM venv, as in
test_pd_connectors.py."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from harness import (
    NIXL_LOOPBACK,
    Instance,
    free_base_port,
    make_model,
    nixl_or_skip,
    prompts,
    start_together,
    vllm_python,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LENGTHS = [97, 129]  # the last prompt token alone in its block: D recomputes it, so compare the full blocks before


#: The connectors of the two cases (nixl: UCX over TCP on loopback)
CONNECTORS = {"shm": {"type": "shm"}, "nixl": NIXL_LOOPBACK}


@pytest.fixture(scope="module", params=sorted(CONNECTORS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    py = vllm_python()
    kind = request.param
    if kind == "nixl":
        nixl_or_skip(py)
    root = tmp_path_factory.mktemp(f"vllm_tp_{kind}")
    model = make_model(py, root / "model", 1)
    extra = {"connector": CONNECTORS[kind], "base_port": free_base_port(), "load_timeout_s": 30}
    d, p = start_together(
        lambda: Instance(
            py,
            {"model": str(model), "kv_role": "kv_consumer", "extra": extra, "tp": 2},
            cpu="0|1",
            log=root / "decode_tp2.log",
            timeout_s=600,
        ),
        lambda: Instance(
            py, {"model": str(model), "kv_role": "kv_producer", "extra": extra}, cpu="1", log=root / "prefill_tp1.log"
        ),
    )
    print("startup:", kind, {"decode_tp2_s": round(d.startup_s, 1), "prefill_tp1_s": round(p.startup_s, 1)})
    yield d, p, kind
    p.close()
    d.close()


def test_each_decode_rank_gets_the_prefill_pages_of_its_heads(pair: Any) -> None:
    d, p, kind = pair
    ps = prompts(LENGTHS, seed=21)
    out_p = p.generate(ps, [{"do_remote_decode": True, "decode_tp_size": 2} for _ in ps], max_tokens=1)
    for prompt, res in zip(ps, out_p):
        params = res["kv_transfer_params"]
        assert params["decode_tp_size"] == 2 and params["remote_tp_size"] == 1
        before = d.settled_metrics().get("vllm:kvferry_requests_loaded", 0)
        d.generate([prompt], [params], max_tokens=1)
        # both ranks loaded (the engine counts the request once per rank; a rank's stats can
        # reach the metrics a step later, so read them after one more step)
        assert d.settled_metrics()["vllm:kvferry_requests_loaded"] - before == 2
        full = (len(prompt) - 1) // 32
        d.send({"op": "pages", "blocks": full})
        ranks = d.reply(120)["ranks"]
        p.send({"op": "pages", "blocks": full, "transfer_id": params["transfer_id"], "slices": [[0, 1], [1, 2]]})
        [prefill] = p.reply(120)["ranks"]
        assert prefill["heads"] == 2 and [r["heads"] for r in ranks] == [1, 1]
        zero = hashlib.sha256(bytes(full * 32 * 64 * 2)).hexdigest()  # one head's pages, all zero
        for layer, row in enumerate(prefill["hashes"]):
            assert zero not in row and row[0] != row[1]
            for rank, got in enumerate(ranks):
                assert got["hashes"][layer] == [row[rank]], (layer, rank)
    sent = p.settled_metrics()
    # nixl: every page byte was read in place (each decode rank its head, from the prefill's
    # cache: 4 layers x 32 tokens x 2 * 32 (K and V) bf16 per block and head, 2 heads); only
    # the payloads' headers went through the pool (the rest of bytes_sent)
    pages = sum(-(-len(q) // 32) for q in ps) * 4 * 32 * 64 * 2 * 2
    in_place = sent.get("vllm:kvferry_bytes_in_place", 0)
    assert in_place == (pages if kind == "nixl" else 0), sent
    assert sent["vllm:kvferry_bytes_sent"] > pages
