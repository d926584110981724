"""Every public name of the reference's manager module, routing helpers and KV port constants
exists in compat, read from the released reference package itself (not from a list of ours)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

import kvferry.app.compat as compat

#: starting a node imports vLLM, which takes minutes on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PREFIX = "vllm_omni.distributed.omni_connectors."
#: reference module -> the compat module with the same names (what the reference's own tests
#: are run through, see test_reference_unit_tests.py)
MODULES = {
    PREFIX + "kv_transfer_manager": "kvferry.app.compat.manager",
    PREFIX + "utils.kv_utils": "kvferry.app.compat.kv_utils",
    PREFIX + "utils.initialization": "kvferry.app.compat.initialization",
    PREFIX + "utils.env": "kvferry.app.compat.kv_utils",
}
PORT_CONSTANTS = ["KV_TRANSFER_PORT_OFFSET", "KV_RANK_PORT_STRIDE", "KV_REPLICA_PORT_STRIDE", "LayerKV"]
#: of utils/initialization only the KV port constants; of utils/env only expand_env_int
ONLY = {PREFIX + "utils.initialization": set(PORT_CONSTANTS[:3]), PREFIX + "utils.env": {"expand_env_int"}}


@pytest.fixture(scope="module")
def reference_names(reference_python, nodes) -> dict[str, Any]:
    node = nodes(reference_python, "names")
    answer = node.ask(
        {"op": "names", "modules": list(MODULES), "constants": PORT_CONSTANTS, "also": ["_TransferTopoConfig"]}
    )
    return answer["modules"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_public_name_exists(reference_names, module) -> None:
    ours = importlib.import_module(MODULES[module])
    names = set(reference_names[module]["names"]) - {"_TransferTopoConfig"}
    if module in ONLY:
        names &= ONLY[module]
    assert names, f"the reference's {module} listed no names (is the venv right?)"
    missing = sorted(n for n in names if not hasattr(ours, n))
    assert not missing, f"{MODULES[module]} lacks {missing}"
    for name in names & set(PORT_CONSTANTS[:3]):
        assert getattr(ours, name) == getattr(compat, name)


@pytest.mark.parametrize("cls", ["OmniKVTransferManager", "KVCacheTransferData", "OmniKVCacheConfig"])
def test_every_public_member_exists(reference_names, cls) -> None:
    members = reference_names[PREFIX + "kv_transfer_manager"]["members"][cls]
    ours = getattr(compat, cls)
    missing = [m for m in members if not hasattr(ours, m) and m not in getattr(ours, "__dataclass_fields__", {})]
    probe = ours(compat.OmniKVCacheConfig()) if cls == "OmniKVTransferManager" else None
    if probe is not None:  # instance attributes (config, hooks) are set in __init__
        missing = [m for m in missing if not hasattr(probe, m)]
        probe.close()
    assert not missing, f"compat.{cls} lacks {missing}"


def test_topo_config_has_the_reference_fields(reference_names) -> None:
    fields = reference_names[PREFIX + "kv_transfer_manager"]["members"]["_TransferTopoConfig"]
    with compat.OmniKVTransferManager(compat.OmniKVCacheConfig()) as m:
        snapshot = m.topo_config
        missing = [f for f in fields if not hasattr(snapshot, f)]
        assert not missing, missing
        assert snapshot.role is compat.ReceiveRole.LOCAL and snapshot.is_local and not snapshot.tp_active
        assert m.topo_config is snapshot
        with pytest.raises(AttributeError):  # read-only
            snapshot.role = compat.ReceiveRole.LEADER


def test_receive_role_values_match(reference_names) -> None:
    assert "ReceiveRole" in reference_names[PREFIX + "kv_transfer_manager"]["names"]
    assert {r.value for r in compat.ReceiveRole} == {"local", "leader", "follower"}
