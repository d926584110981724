"""The reference's own unit tests for this path, run against compat through a module-name
mapping only (``reference_alias.py``: the reference's module names point at compat's modules).

The reference's wheel ships no tests and the package registry has no source distribution of
0.30.0, so their files come from the reference's repository (``tests/distributed/
omni_connectors/``); ``KVFERRY_REFERENCE_TESTS`` names a folder holding them (docs/compat.md
says how to get them). Without it this module skips, saying why, also under CI, which reaches
only package registries.

Each file runs twice in the reference venv: as it is (the reference itself: a test of another
revision than the release may fail there and is not counted), and through the mapping. Every
test that passes on the reference must pass through compat, except those listed in
:data:`CANNOT_APPLY` (they reach private attributes or patch the reference's internals).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import xml.etree.ElementTree as ET

import pytest

#: starting a node imports vLLM, which takes minutes on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = pathlib.Path(__file__).resolve().parent
TESTS_ENV = "KVFERRY_REFERENCE_TESTS"
FILES = ("test_kv_flow.py", "test_tp_rank_aware.py")
#: Whole files that cannot apply (not run): why.
FILES_CANNOT_APPLY = {
    "test_kv_recv_tp_consensus.py": "imports the private _TransferTopoConfig and calls _tp_local_receive_consensus",
    "test_kv_async_prefetch.py": "every test injects manager._connector and reads _async_prefetch/_prefetch_futures",
}
#: test (``file::[Class::]name`` without parameters) -> why it cannot apply through compat
CANNOT_APPLY = {
    "test_kv_flow::test_manager_extraction": "injects its connector as manager._connector (private)",
    "test_kv_flow::test_manager_extraction_tuple_layout": "injects its connector as manager._connector",
    "test_kv_flow::test_manager_extraction_mismatched_kv_block_counts": "injects manager._connector",
    "test_kv_flow::test_receive_kv_cache_uses_exponential_backoff": "patches the module's time; sets _connector",
    "test_tp_rank_aware::TestUpdateSenderInfoBase::test_stores_base_host_and_port": "reads _sender_base_*",
    "test_tp_rank_aware::TestUpdateSenderInfoBase::test_rank1_adjusts_default_port_but_preserves_base": "_sender_*",
    "test_tp_rank_aware::TestUpdateSenderInfoBase::test_nested_sender_info_resolves_correctly": "_sender_base_*",
    "test_tp_rank_aware::TestReceiveConstructsMetadata::test_tp1_no_metadata_passed": "sets _connector",
    "test_tp_rank_aware::TestReceiveConstructsMetadata::test_homogeneous_tp2_passes_metadata": "sets _connector",
    "test_tp_rank_aware::TestReceiveConstructsMetadata::test_heterogeneous_tp4_to_tp2_rank0_multiple_metadata": (
        "sets _connector"
    ),
    "test_tp_rank_aware::TestSenderSideSlicing::test_transfer_slices_before_sending_to_multiple_targets": (
        "calls _transfer_kv_cache"
    ),
    "test_tp_rank_aware::TestDistributedReceive": "patches the reference's global parallel state, reads its messages",
    "test_tp_rank_aware::TestAutoDetectTP": "reads _tp_topo",
}


def _results(junit: pathlib.Path) -> dict[str, bool]:
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}".replace(".", "::").split("[")[0]
        ok = case.find("failure") is None and case.find("error") is None and case.find("skipped") is None
        out[name] = out.get(name, True) and ok
    return out


def _excluded(name: str) -> bool:
    return any(name == k or name.startswith(k + "::") for k in CANNOT_APPLY)


def _run(python: str, folder: pathlib.Path, junit: pathlib.Path, *plugin: str) -> dict[str, bool]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "PYTHONPATH")}
    env["VLLM_PLUGINS"] = "none"
    if plugin:
        env["PYTHONPATH"] = str(HERE)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, f"--junitxml={junit}", *FILES]
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    assert junit.exists(), f"pytest did not run: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    return _results(junit)


@pytest.fixture(scope="module")
def runs(reference_python, tmp_path_factory) -> tuple[dict[str, bool], dict[str, bool]]:
    source = os.environ.get(TESTS_ENV, "")
    if not source:
        pytest.skip(
            f"{TESTS_ENV} is not set: the reference's unit tests are not in its released packages; "
            "docs/compat.md says where they come from"
        )
    folder = tmp_path_factory.mktemp("reference-tests")
    for name in FILES:  # copied alone: the reference's conftest and suite are not needed
        (folder / name).write_bytes((pathlib.Path(source) / name).read_bytes())
    reference = _run(reference_python, folder, folder / "reference.xml")
    through_compat = _run(reference_python, folder, folder / "compat.xml", "-p", "reference_alias")
    return reference, through_compat


def test_public_behaviour_tests_pass_through_compat(runs) -> None:
    reference, through_compat = runs
    applicable = [n for n, ok in reference.items() if ok and not _excluded(n)]
    assert len(applicable) >= 30, applicable  # the files ran, and most of them apply
    failing = sorted(n for n in applicable if not through_compat.get(n, False))
    assert not failing, f"pass on the reference, fail through compat: {failing}"


def test_the_cannot_apply_list_is_current(runs) -> None:
    """Each listed test passes on the reference and fails through compat (else: fix the list)."""
    reference, through_compat = runs
    for key in CANNOT_APPLY:
        matched = [n for n in reference if n == key or n.startswith(key + "::")]
        assert matched, f"{key} names no test"
        assert any(reference[n] and not through_compat.get(n, False) for n in matched), key
