"""One node of a mixed pipeline: a sender or a receiver stage, either the reference's manager or
kvferry's compat manager, over either side's shared-memory connector.

Run as a script by ``test_reference_pipelines.py``, under the reference venv's interpreter (the
reference's own manager or connector is needed) or under kvferry's (kvferry's manager and
kvferry's connector only). It speaks JSON lines: one line on stdout per event; a sender then
waits for ``exit`` on stdin, since shared memory it published must outlive the read.

    reference_node.py SPEC_JSON

SPEC keys: ``side`` ("ref" or "kvf"), ``role`` ("send" or "recv"), ``connector`` ("ref-shm" or
"kvf-shm"), ``request_id``, ``seed``, ``layers``, ``blocks``, ``block_size``, ``heads``,
``head_dim``, ``dtype``, ``block_ids``, ``seq_len``, ``namespace`` and ``port`` (kvf-shm),
``out`` (receiver: where the received tensors are saved), ``timeout_s`` (receiver).
"""

from __future__ import annotations

import json
import os
import select
import sys
import types
from typing import Any

import torch

#: The stage pair every node uses (the reference's keys: omni_0_to_1_kv_cache_<request>).
FROM_STAGE, TO_STAGE = "0", "1"
#: A sender waits at most this long for ``exit`` (a parent that died must not leave it behind).
EXIT_WAIT_S = 300.0
#: Name under which a reference node registers kvferry's shm connector with the reference's factory.
KVFERRY_SHM = "KvferryShmConnector"


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def source_caches(spec: dict[str, Any]) -> list[torch.Tensor]:
    """The sender's paged cache: per layer ``[2, blocks, block_size, heads, head_dim]`` (the
    stacked layout both managers read), arbitrary bit patterns from ``seed``."""
    dtype = getattr(torch, spec["dtype"])
    shape = (2, spec["blocks"], spec["block_size"], spec["heads"], spec["head_dim"])
    gen = torch.Generator().manual_seed(spec["seed"])
    out = []
    for _ in range(spec["layers"]):
        n = 1
        for d in shape:
            n *= d
        raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        # no NaN payloads in float caches: the decode side compares values too
        t = raw.view(dtype).reshape(shape)
        if dtype.is_floating_point:
            t = torch.nan_to_num(t, nan=0.0, posinf=1.0, neginf=-1.0)
        out.append(t.contiguous())
    return out


def connector_config(spec: dict[str, Any], role: str) -> dict[str, Any]:
    """The connector config each manager is given (kvferry's shm: sender port and namespace)."""
    if spec["connector"] == "ref-shm":
        return {"type": "SharedMemoryConnector"}
    if spec["side"] == "ref":
        base = {"type": KVFERRY_SHM, "namespace": spec["namespace"], "role": "sender" if role == "send" else "receiver"}
        if role == "send":
            base["port"] = spec["port"]
        return base
    # kvferry's manager gives its shm connector role and port itself (port = zmq_port + 100 + stage)
    return {"type": "shm", "namespace": spec["namespace"], "zmq_port": spec["port"] - 100}


def reference_manager(spec: dict[str, Any], role: str) -> Any:
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.kv_transfer_manager import OmniKVCacheConfig, OmniKVTransferManager

    if spec["connector"] == "kvf-shm":
        from kvferry.adapters.connectors.shm import ShmConnector

        # a third-party connector, plugged in through the reference's public factory
        OmniConnectorFactory.register_connector(KVFERRY_SHM, ShmConnector.from_config)
    config = OmniKVCacheConfig(
        connector_config=connector_config(spec, role),
        from_stage=FROM_STAGE,
        to_stage=TO_STAGE if role == "send" else None,
        stage_id=None if role == "send" else TO_STAGE,
        need_send_cache=role == "send",
        need_recv_cache=role == "recv",
        recv_timeout=spec.get("timeout_s", 30.0),
    )
    return OmniKVTransferManager(config)


def kvferry_manager(spec: dict[str, Any], role: str) -> Any:
    from kvferry.app.compat import OmniKVCacheConfig, OmniKVTransferManager

    kwargs: dict[str, Any] = {"tp_rank": 0, "tp_size": 1}
    if spec["connector"] == "ref-shm":
        from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

        # the reference's own connector, injected into kvferry's compat manager
        kwargs["connector"] = SharedMemoryConnector({})
    config = OmniKVCacheConfig(
        connector_config=connector_config(spec, role),
        from_stage=FROM_STAGE,
        to_stage=TO_STAGE if role == "send" else None,
        stage_id=None if role == "send" else TO_STAGE,
        need_send_cache=role == "send",
        need_recv_cache=role == "recv",
        recv_timeout=spec.get("timeout_s", 30.0),
    )
    return OmniKVTransferManager(config, **kwargs)


def wait_for_exit() -> None:
    ready, _, _ = select.select([sys.stdin], [], [], EXIT_WAIT_S)
    if ready:
        sys.stdin.readline()


def send(spec: dict[str, Any]) -> None:
    manager = reference_manager(spec, "send") if spec["side"] == "ref" else kvferry_manager(spec, "send")
    caches = source_caches(spec)
    request = {spec["request_id"]: {"block_ids": list(spec["block_ids"]), "seq_len": spec["seq_len"]}}
    processed = manager.handle_finished_requests_kv_transfer(request, caches, spec["block_size"], spec["dtype"])
    connector = manager.get_connector
    connector = connector() if callable(connector) else connector
    event: dict[str, Any] = {"event": "sent", "processed": list(processed), "connector": type(connector).__name__}
    outcomes = getattr(manager, "last_send_outcomes", None)
    if outcomes:
        event["outcomes"] = [o.kind.value if hasattr(o.kind, "value") else str(o.kind) for o in outcomes]
    say(**event)
    wait_for_exit()
    if hasattr(manager, "close"):
        manager.close()


def receive(spec: dict[str, Any]) -> None:
    manager = reference_manager(spec, "recv") if spec["side"] == "ref" else kvferry_manager(spec, "recv")
    params = types.SimpleNamespace()
    req = types.SimpleNamespace(request_id=spec["request_id"], sampling_params=params)
    if spec["connector"] == "kvf-shm":
        req.kv_sender_info = {"host": "127.0.0.1", "zmq_port": spec["port"]}
    ok = manager.receive_kv_cache(req)
    kv = getattr(req, "past_key_values", None)
    saved = None
    if kv is not None:
        saved = {
            "key_cache": [None if t is None else t.clone() for t in kv.key_cache],
            "value_cache": [None if t is None else t.clone() for t in kv.value_cache],
            "metadata": getattr(req, "kv_metadata", None),
            "same_on_params": getattr(params, "past_key_values", None) is kv,
        }
        torch.save(saved, spec["out"])
    say(event="received", ok=bool(ok), has_kv=kv is not None, out=spec["out"] if saved else None)
    if hasattr(manager, "close"):
        manager.close()


def main() -> None:
    os.environ.pop("LOCAL_RANK", None)
    spec = json.loads(sys.argv[1])
    (send if spec["role"] == "send" else receive)(spec)


if __name__ == "__main__":
    main()
