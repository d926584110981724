"""Mixed pipelines against the released reference (vllm-omni 0.30.0), in separate processes.

A reference node and a kvferry node exchange one request's KV in both directions, through the
reference's ``SharedMemoryConnector`` and through kvferry's shm connector, and with vllm-omni's
connector name in one config dict that both managers are built from (``*-by-name``):

- ``ref`` sender: the reference's ``OmniKVTransferManager``; with kvferry's shm connector it is
  registered through the reference's public connector factory, as a third-party connector;
- ``kvf`` sender/receiver: kvferry's compat manager; with the reference's connector, that
  connector instance is injected (``connector=``).

Processes: R1 (reference venv, the reference's manager), R2 (reference venv, kvferry's manager
with the reference's connector), K (kvferry's venv, kvferry's manager and connector). Each pair
is two of them. The received tensors are compared bit for bit with what the test computes
itself from the sender's seed (plain indexing of the paged cache), and must differ from another
seed's; a request that was never sent must not be received.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvferry.adapters.platform import free_port

#: starting a node imports vLLM, which takes minutes on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = pathlib.Path(__file__).resolve().parent

_spec = importlib.util.spec_from_file_location("reference_node", HERE / "reference_node.py")
assert _spec is not None and _spec.loader is not None
node_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(node_module)

GEOMETRY = {"layers": 3, "blocks": 8, "block_size": 4, "heads": 2, "head_dim": 8, "dtype": "bfloat16"}
BLOCK_IDS, SEQ_LEN = [5, 2, 7], 10  # the last block is partial

#: name -> (sender process, sender side, receiver process, receiver side, connector)
SCENARIOS = {
    "ref-to-kvf-via-ref-shm": ("R1", "ref", "R2", "kvf", "ref-shm"),
    "kvf-to-ref-via-ref-shm": ("R2", "kvf", "R1", "ref", "ref-shm"),
    "ref-to-kvf-via-kvf-shm": ("R1", "ref", "K", "kvf", "kvf-shm"),
    "kvf-to-ref-via-kvf-shm": ("K", "kvf", "R1", "ref", "kvf-shm"),
    # vllm-omni's deploy config as it is: both managers built by from_od_config from the same
    # omni_kv_config naming "SharedMemoryConnector", nothing injected (docs/compat.md)
    "ref-to-kvf-by-name": ("R1", "ref", "R2", "kvf", "ref-names"),
    "kvf-to-ref-by-name": ("R2", "kvf", "R1", "ref", "ref-names"),
    "kvf-to-kvf-by-name": ("R2", "kvf", "R2", "kvf", "ref-names"),
}


def expected(spec: dict[str, Any], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What the receiver must hold, computed here: per layer the chosen blocks' tokens."""
    caches = node_module.source_caches({**spec, "seed": seed})
    ids = torch.tensor(spec["block_ids"])
    keys = [c[0][ids].flatten(0, 1)[: spec["seq_len"]] for c in caches]
    values = [c[1][ids].flatten(0, 1)[: spec["seq_len"]] for c in caches]
    return keys, values


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.fixture(scope="module")
def procs(reference_python, kvferry_python, nodes) -> dict[str, Any]:
    """The three nodes (started together; all ready)."""
    started = {
        "R1": nodes(reference_python, "R1-reference-manager"),
        "R2": nodes(reference_python, "R2-kvferry-manager-reference-connector"),
        "K": nodes(kvferry_python, "K-kvferry"),
    }
    for node in started.values():
        node.wait_ready()
    return started


@pytest.fixture(scope="module")
def transfers(procs, tmp_path_factory) -> dict[str, Any]:
    """Every scenario run once: ``{name: (spec, send answer, receive answer, control answer)}``."""
    out_dir = tmp_path_factory.mktemp("received")
    namespace = f"rc{os.getpid()}"
    results: dict[str, Any] = {}
    rids: list[str] = []
    for i, (name, (src, src_side, dst, dst_side, connector)) in enumerate(SCENARIOS.items()):
        rid = f"interop-{uuid.uuid4().hex[:12]}"
        rids.append(rid)
        spec = {
            **GEOMETRY,
            "connector": connector,
            "request_id": rid,
            "seed": 100 + i,
            "block_ids": BLOCK_IDS,
            "seq_len": SEQ_LEN,
            "namespace": namespace,
            "port": free_port(),
            "timeout_s": 20.0,
        }
        try:
            sent = procs[src].ask({"op": "send", **spec, "side": src_side})
            received = procs[dst].ask(
                {"op": "recv", **spec, "side": dst_side, "out": str(out_dir / f"{name}.pt")}, timeout_s=120
            )
            control = procs[dst].ask(
                {
                    "op": "recv",
                    **spec,
                    "side": dst_side,
                    "request_id": rid + "-never-sent",
                    "timeout_s": 1.0,
                    "out": str(out_dir / f"{name}-control.pt"),
                },
                timeout_s=120,
            )
        except AssertionError as exc:  # reported by this scenario's tests; the others still run
            results[name] = exc
            continue
        results[name] = (spec, sent, received, control, out_dir / f"{name}.pt")
    yield results
    for rid in rids:  # the reference's segments are named by key; a failed read would leave them
        for leftover in (
            f"/dev/shm/omni_0_to_1_kv_cache_{rid}",
            f"/dev/shm/shm_omni_0_to_1_kv_cache_{rid}_lockfile.lock",
        ):
            if os.path.exists(leftover):
                os.remove(leftover)


def scenario(transfers: dict[str, Any], name: str) -> Any:
    result = transfers[name]
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_kv_crosses_bit_exact(transfers, name) -> None:
    spec, sent, received, control, out = scenario(transfers, name)
    assert sent["processed"] == [spec["request_id"]], sent
    if "sent" in sent:  # kvferry's typed outcome beside the reference's return value
        assert sent["sent"] == [True]
    assert received["ok"] and received["has_kv"], received
    if "kind" in received:
        assert received["kind"] == "received", received
    got = torch.load(out)
    keys, values = expected(spec, spec["seed"])
    assert len(got["key_cache"]) == len(keys) and len(got["value_cache"]) == len(values)
    for layer, (k, v) in enumerate(zip(keys, values)):
        assert same_bits(got["key_cache"][layer], k), f"{name}: key layer {layer} differs"
        assert same_bits(got["value_cache"][layer], v), f"{name}: value layer {layer} differs"
    other_keys, _ = expected(spec, spec["seed"] + 1)  # the data was used: another seed differs
    assert not same_bits(got["key_cache"][0], other_keys[0])
    meta = got["metadata"]
    assert meta["seq_len"] == SEQ_LEN and meta["block_size"] == GEOMETRY["block_size"]
    assert got["on_params"], "past_key_values is set on sampling_params too"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_request_never_sent_is_not_received(transfers, name) -> None:
    _, _, _, control, _ = scenario(transfers, name)
    assert not control["ok"] and not control["has_kv"], control
    if "kind" in control:
        assert control["kind"] == "timed_out", control


def test_the_names_kvferry_serves_are_the_ones_the_reference_registers(reference_python, nodes) -> None:
    from kvferry.app.registry import REFERENCE_CONNECTORS

    node = nodes(reference_python, "names-reference-factory")
    assert node.ask({"op": "connector_names"})["names"] == sorted(REFERENCE_CONNECTORS)


def test_without_vllm_omni_the_reference_name_fails_at_start(kvferry_python, nodes) -> None:
    """kvferry's venv has no vllm_omni: the same config is refused when the manager is built,
    naming the key and the names that can be served (no silent run without KV)."""
    node = nodes(kvferry_python, "K-no-vllm-omni")
    node.wait_ready()
    for role in ("send", "recv"):
        spec = {**GEOMETRY, "connector": "ref-names", "side": "kvf", "request_id": f"never-{role}", "seed": 0}
        spec.update(block_ids=BLOCK_IDS, seq_len=SEQ_LEN, timeout_s=1.0, out=os.devnull)
        assert node.proc.stdin is not None
        node.proc.stdin.write(json.dumps({"op": role, **spec}) + "\n")
        node.proc.stdin.flush()
        answer = node.read(timeout_s=120)
        assert "connector_config.type 'SharedMemoryConnector'" in answer.get("error", ""), answer
        assert "available: memory, mooncake, nixl, shm, zmq" in answer["error"]


# ------------------------------------------------------------------------------ refusals
#: name -> (receiver process, receiver side, kv_layout the sender names)
REFUSALS = {
    "kvf-refuses-to-ref": ("R1", "ref", None),
    "kvf-refuses-to-kvf": ("R2", "kvf", None),
    "kvf-named-layout-to-ref": ("R1", "ref", "packed"),  # control: named, the KV is sent
}


@pytest.fixture(scope="module")
def refusals(procs, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """kvferry's sender (vllm-omni's name, nothing injected) handed vLLM CPU's cache shape
    without a layout name; each receiver waits with recv_timeout 30 s."""
    out_dir = tmp_path_factory.mktemp("refusals")
    results: dict[str, Any] = {}
    rids = []
    for i, (name, (dst, side, layout)) in enumerate(REFUSALS.items()):
        rid = f"refused-{uuid.uuid4().hex[:12]}"
        rids.append(rid)
        spec = {**GEOMETRY, "connector": "ref-names", "cache": "vllm_cpu", "request_id": rid, "seed": 300 + i}
        spec.update(block_ids=BLOCK_IDS, seq_len=SEQ_LEN, timeout_s=30.0, kv_layout=layout)
        try:
            sent = procs["R2"].ask({"op": "send", **spec, "side": "kvf"})
            received = procs[dst].ask({"op": "recv", **spec, "side": side, "out": str(out_dir / f"{name}.pt")})
        except AssertionError as exc:
            results[name] = exc
            continue
        results[name] = (spec, sent, received, out_dir / f"{name}.pt")
    yield results
    for rid in rids:
        for leftover in (
            f"/dev/shm/omni_0_to_1_kv_cache_{rid}",
            f"/dev/shm/shm_omni_0_to_1_kv_cache_{rid}_lockfile.lock",
        ):
            if os.path.exists(leftover):
                os.remove(leftover)


def test_a_refusal_reaches_a_kvferry_receiver_at_once(refusals) -> None:
    spec, sent, received, _ = scenario(refusals, "kvf-refuses-to-kvf")
    assert sent["processed"] == [spec["request_id"]] and sent["sent"] == [False] and sent["reasons"] == ["error"]
    assert received["kind"] == "refused" and not received["has_kv"], received
    assert "omni_kv_config.kv_layout" in received["detail"] and "[8, 2, 4, 16]" in received["detail"]
    assert received["seconds"] < 5.0  # recv_timeout is 30 s: a liveness bound, not a speed claim


def test_a_reference_receiver_reads_the_marker_as_no_kv_at_once(refusals) -> None:
    spec, sent, received, out = scenario(refusals, "kvf-refuses-to-ref")
    assert sent["sent"] == [False]
    # the reference decodes an empty payload: every layer absent, the refusal in the metadata
    assert received["ok"] and received["has_kv"] and received["present"] == 0, received
    assert received["layers"] == GEOMETRY["layers"] and received["metadata_keys"] == ["kvferry_refused"]
    assert received["seconds"] < 5.0
    assert torch.load(out)["metadata"]["kvferry_refused"]["reason"] == "error"


def test_the_named_layout_control_sends_the_kv(refusals) -> None:
    spec, sent, received, out = scenario(refusals, "kvf-named-layout-to-ref")
    assert sent["sent"] == [True], sent
    assert received["ok"] and received["present"] == 2 * GEOMETRY["layers"], received
    got = torch.load(out)
    caches = node_module.source_caches({**spec, "seed": spec["seed"]})
    ids = torch.tensor(spec["block_ids"])
    head_dim = GEOMETRY["head_dim"]
    for layer, c in enumerate(caches):  # the packed layout read by hand
        tokens = c[ids].permute(0, 2, 1, 3).flatten(0, 1)[: spec["seq_len"]]
        assert same_bits(got["key_cache"][layer], tokens[..., :head_dim].contiguous())
        assert same_bits(got["value_cache"][layer], tokens[..., head_dim:].contiguous())
    assert "kvferry_refused" not in got["metadata"]
