"""A node of mixed pipelines: sender and receiver stages, the reference's manager or kvferry's
compat manager, over either side's shared-memory connector; and the reference's codec.

Run as a script by the tests in this folder, under the reference venv's interpreter (when the
reference's manager, connector or codec is needed) or under kvferry's. It reads one JSON command
per line on stdin and answers one JSON line on stdout; it stays up until ``{"op": "exit"}`` or
the end of stdin, so shared memory a sender published outlives the read.

Commands: ``send`` and ``recv`` (a SPEC, below), ``encode`` / ``decode`` / ``faults`` (the
reference's codec, see :func:`encode`), ``exit``.

SPEC keys: ``side`` ("ref" or "kvf": whose manager), ``connector`` ("ref-shm", "kvf-shm", or
"ref-names": both managers built by ``from_od_config`` from one ``omni_kv_config`` naming
vllm-omni's ``SharedMemoryConnector``, nothing injected; ``kv_layout`` for its sender),
``request_id``, ``seed``, ``layers``, ``blocks``, ``block_size``, ``heads``, ``head_dim``,
``dtype``, ``block_ids``, ``seq_len``, ``namespace`` and ``port`` (kvf-shm), ``out`` (receiver:
where the received tensors are saved), ``timeout_s`` (receiver).
"""

from __future__ import annotations

import os
import sys
import time
import types
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
from jsonlines import commands, say  # noqa: E402

#: The stage pair every node uses (the reference's keys: omni_0_to_1_kv_cache_<request>).
FROM_STAGE, TO_STAGE = "0", "1"
#: Name under which a reference node registers kvferry's shm connector with the reference's factory.
KVFERRY_SHM = "KvferryShmConnector"


def source_caches(spec: dict[str, Any]) -> list[torch.Tensor]:
    """The sender's paged cache: per layer ``[2, blocks, block_size, heads, head_dim]`` (the
    stacked layout both managers read), arbitrary bit patterns from ``seed``. With
    ``"cache": "vllm_cpu"``: vLLM CPU's ``[blocks, heads, block_size, 2*head_dim]``, a shape
    three layouts fit (kvferry refuses to guess it)."""
    dtype = getattr(torch, spec["dtype"])
    shape: tuple[int, ...] = (2, spec["blocks"], spec["block_size"], spec["heads"], spec["head_dim"])
    if spec.get("cache") == "vllm_cpu":
        shape = (spec["blocks"], spec["heads"], spec["block_size"], 2 * spec["head_dim"])
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


def omni_kv_config(spec: dict[str, Any], role: str) -> dict[str, Any]:
    """One stage's ``omni_kv_config`` as vllm-omni's deploy config gives it to either manager
    (connector "ref-names": vllm-omni's connector name, nothing injected)."""
    connector = {"type": "SharedMemoryConnector"}
    timeout = spec.get("timeout_s", 30.0)
    stages = {"omni_from_stage": FROM_STAGE, "omni_to_stage": TO_STAGE}  # strings, as vllm-omni injects them
    if role == "send":
        return {
            "connector_config": connector,
            **stages,
            "need_send_cache": True,
            **({"kv_layout": spec["kv_layout"]} if spec.get("kv_layout") else {}),
        }
    return {
        "connector_config": connector,
        **stages,
        "stage_id": int(TO_STAGE),
        "engine_input_source": [int(FROM_STAGE)],
        "need_recv_cache": True,
        "recv_timeout": timeout,
    }


def by_name(spec: dict[str, Any], role: str) -> Any:
    """Either side's manager built as the engines build it, from the same config dict."""
    model_config = types.SimpleNamespace(omni_kv_config=omni_kv_config(spec, role))
    if spec["side"] == "ref":
        from vllm_omni.distributed.omni_connectors.kv_transfer_manager import OmniKVTransferManager

        return OmniKVTransferManager.from_od_config(model_config)
    from kvferry.app.compat import OmniKVTransferManager as KvferryManager

    return KvferryManager.from_od_config(model_config, tp_rank=0, tp_size=1)


def reference_manager(spec: dict[str, Any], role: str) -> Any:
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.kv_transfer_manager import OmniKVCacheConfig, OmniKVTransferManager

    if spec["connector"] == "kvf-shm":
        from kvferry.adapters.connectors.shm.connector import ShmConnector

        # a third-party connector, plugged in through the reference's public factory
        if KVFERRY_SHM not in OmniConnectorFactory.list_registered_connectors():
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


def manager_for(spec: dict[str, Any], role: str) -> Any:
    if spec["connector"] == "ref-names":
        return by_name(spec, role)
    return reference_manager(spec, role) if spec["side"] == "ref" else kvferry_manager(spec, role)


def send(spec: dict[str, Any]) -> dict[str, Any]:
    manager = manager_for(spec, "send")
    MANAGERS.append(manager)
    caches = source_caches(spec)
    request = {spec["request_id"]: {"block_ids": list(spec["block_ids"]), "seq_len": spec["seq_len"]}}
    processed = manager.handle_finished_requests_kv_transfer(request, caches, spec["block_size"], spec["dtype"])
    event: dict[str, Any] = {"processed": list(processed), "connector": type(manager.get_connector).__name__}
    outcomes = getattr(manager, "last_send_outcomes", None)
    if outcomes:
        event["sent"] = [bool(o.ok) for o in outcomes]
        event["reasons"] = [None if o.reason is None else o.reason.value for o in outcomes]
    return event


def receive(spec: dict[str, Any]) -> dict[str, Any]:
    manager = manager_for(spec, "recv")
    MANAGERS.append(manager)
    params = types.SimpleNamespace()
    req = types.SimpleNamespace(request_id=spec["request_id"], sampling_params=params)
    if spec["connector"] == "kvf-shm":
        req.kv_sender_info = {"host": "127.0.0.1", "zmq_port": spec["port"]}
    start = time.monotonic()
    ok = manager.receive_kv_cache(req)
    seconds = time.monotonic() - start
    kv = getattr(req, "past_key_values", None)
    if kv is not None:
        torch.save(
            {
                "key_cache": [None if t is None else t.clone() for t in kv.key_cache],
                "value_cache": [None if t is None else t.clone() for t in kv.value_cache],
                "metadata": getattr(req, "kv_metadata", None),
                "on_params": getattr(params, "past_key_values", None) is kv,
            },
            spec["out"],
        )
    event: dict[str, Any] = {"ok": bool(ok), "has_kv": kv is not None, "seconds": seconds}
    outcome = getattr(manager, "last_receive_outcome", None)
    if outcome is not None:  # kvferry's typed outcome
        event.update(kind=outcome.kind.value, detail=outcome.detail)
    if kv is not None:
        event["layers"] = len(kv.key_cache)
        event["present"] = sum(t is not None for t in [*kv.key_cache, *kv.value_cache])
        meta = getattr(req, "kv_metadata", None)
        event["metadata_keys"] = sorted(meta) if isinstance(meta, dict) else None
    return event


def connector_names(cmd: dict[str, Any]) -> dict[str, Any]:
    """The connector names vllm-omni's factory registers (read from the package)."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    return {"names": sorted(OmniConnectorFactory.list_registered_connectors())}


# ------------------------------------------------------------------------------ the codec
def codec_tensors(dtype_name: str, seed: int) -> dict[str, list[torch.Tensor | None]]:
    """Tensors of one dtype with arbitrary bits: keys of layers 0 and 2, layer 1 absent;
    values of layer 0 only (a shorter list), so absent and missing layers both occur."""
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)

    def make(*shape: int) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        if dtype is torch.bool:  # a bool byte other than 0/1 is no value torch keeps as it is
            raw &= 1
        return raw.view(dtype).reshape(shape)

    return {"key_cache": [make(5, 2, 3), None, make(4, 2, 3)], "value_cache": [make(5, 2, 3)]}


def encode(cmd: dict[str, Any]) -> dict[str, Any]:
    """The reference's ``to_bytes`` of :func:`codec_tensors` per dtype, written to ``dir``."""
    from vllm_omni.distributed.omni_connectors.kv_transfer_manager import KVCacheTransferData

    out = {}
    for i, name in enumerate(cmd["dtypes"]):
        blocks = codec_tensors(name, cmd["seed"] + i)
        data = KVCacheTransferData(f"req-{name}", blocks, [i, 7], {"dtype": name}).to_bytes()
        path = os.path.join(cmd["dir"], f"ref-{name}.bin")
        with open(path, "wb") as f:
            f.write(data)
        out[name] = path
    return {"files": out}


def decode(cmd: dict[str, Any]) -> dict[str, Any]:
    """The reference's ``from_bytes`` of each file; the decoded dicts saved next to it."""
    from vllm_omni.distributed.omni_connectors.kv_transfer_manager import KVCacheTransferData

    out: dict[str, Any] = {}
    for path in cmd["files"]:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            data = KVCacheTransferData.from_bytes(raw)
        except ValueError as exc:  # reported: e.g. a dtype outside the reference's allow-list
            out[path] = {"error": str(exc)}
            continue
        blocks = data["layer_blocks"]
        saved = path + ".decoded.pt"
        torch.save(
            {
                **data,
                "layer_blocks": {n: [None if t is None else t.clone() for t in blocks[n]] for n in blocks},
            },
            saved,
        )
        out[path] = {"saved": saved}
    return {"decoded": out}


def allow_list(cmd: dict[str, Any]) -> dict[str, Any]:
    """The dtypes the reference's decoder accepts (read from the reference, for the tests)."""
    from vllm_omni.distributed.omni_connectors import kv_transfer_manager

    return {"dtypes": sorted(kv_transfer_manager._SAFE_TORCH_DTYPES)}


def faults(cmd: dict[str, Any]) -> dict[str, Any]:
    """What the reference's ``from_bytes`` raises for each malformed payload (type, message)."""
    from vllm_omni.distributed.omni_connectors.kv_transfer_manager import KVCacheTransferData

    out = {}
    for name, hexed in cmd["payloads"].items():
        try:
            KVCacheTransferData.from_bytes(bytes.fromhex(hexed))
            out[name] = None
        except Exception as exc:  # reported, not raised: the test compares
            out[name] = [type(exc).__name__, isinstance(exc, ValueError), str(exc)]
    return {"raised": out}


def names(cmd: dict[str, Any]) -> dict[str, Any]:
    """The reference's public names per module: functions and classes defined there, constants
    named in ``constants``, and each class's public methods, properties and fields."""
    import dataclasses
    import importlib
    import inspect

    out: dict[str, Any] = {}
    for module_name in cmd["modules"]:
        module = importlib.import_module(module_name)
        top, members = [], {}
        for name, obj in vars(module).items():
            if name.startswith("_") and name not in cmd.get("also", ()):
                continue
            defined_here = getattr(obj, "__module__", None) == module_name
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and defined_here or name in cmd["constants"]:
                top.append(name)
            if inspect.isclass(obj) and defined_here or name in cmd.get("also", ()):
                attrs_ = [n for n in vars(obj) if not n.startswith("_")]
                if dataclasses.is_dataclass(obj):
                    attrs_ += [f.name for f in dataclasses.fields(obj)]
                members[name] = sorted(set(attrs_))
        out[module_name] = {"names": sorted(top), "members": members}
    return {"modules": out}


MANAGERS: list[Any] = []
COMMANDS = {
    "send": send,
    "recv": receive,
    "encode": encode,
    "decode": decode,
    "faults": faults,
    "names": names,
    "allow_list": allow_list,
    "connector_names": connector_names,
}


def main() -> None:
    os.environ.pop("LOCAL_RANK", None)
    say(ready=True, python=sys.executable)
    for cmd in commands():
        try:
            say(COMMANDS[cmd["op"]](cmd))
        except Exception as exc:
            say(error=f"{type(exc).__name__}: {exc}")
    for manager in MANAGERS:
        if hasattr(manager, "close"):
            manager.close()
    say(closed=len(MANAGERS))


if __name__ == "__main__":
    main()
