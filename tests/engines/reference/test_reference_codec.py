"""Payload interop with the released reference's codec, for every dtype of the allow-list and
with absent layers (a ``None`` layer and a value list shorter than the key list).

- the reference's ``KVCacheTransferData.to_bytes()`` -> kvferry's decoders (compat's
  ``from_bytes`` and the typed ``decode_payload``), bit for bit; compat's ``to_bytes()`` of the
  same input is the same bytes;
- kvferry's payloads (compat's ``to_bytes()`` and kvferry's own aligned, versioned,
  checksummed layout) -> the reference's ``from_bytes``, bit for bit;
- each malformed payload of tests/core/test_phrases.py raises a ValueError in the reference
  whose text matches the phrase of kvferry's table (core.phrases), as kvferry's does.

The source tensors are made here (and, from the same seed, in the reference's process) with
arbitrary bit patterns; comparisons are of bytes, so NaN payloads compare too.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
from typing import Any

import pytest
import torch

from kvferry.adapters.torch_frames import decode_payload, encode_bytes
from kvferry.app.compat import KVCacheTransferData
from kvferry.core.header import DTYPE_ITEMSIZE
from kvferry.core.phrases import REFERENCE_PHRASES

#: starting a node imports vLLM, which takes minutes on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = pathlib.Path(__file__).resolve().parent

_spec = importlib.util.spec_from_file_location("reference_node", HERE / "reference_node.py")
assert _spec is not None and _spec.loader is not None
node_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(node_module)

_phrases_spec = importlib.util.spec_from_file_location("test_phrases", HERE.parent.parent / "core" / "test_phrases.py")
assert _phrases_spec is not None and _phrases_spec.loader is not None
phrases_module = importlib.util.module_from_spec(_phrases_spec)
_phrases_spec.loader.exec_module(phrases_module)

DTYPES = sorted(DTYPE_ITEMSIZE)
SEED = 7000


def source(name: str) -> dict[str, list[torch.Tensor | None]]:
    return node_module.codec_tensors(name, SEED + DTYPES.index(name))


def same_bits(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def check_layers(decoded: dict[str, Any], name: str) -> None:
    want = source(name)
    keys, values = decoded["layer_blocks"]["key_cache"], decoded["layer_blocks"]["value_cache"]
    assert len(keys) == len(values) == 3  # nl = number of key layers; missing values are None
    for i in range(3):
        assert same_bits(keys[i], want["key_cache"][i]), f"{name}: key layer {i}"
        want_v = want["value_cache"][i] if i < len(want["value_cache"]) else None
        assert same_bits(values[i], want_v), f"{name}: value layer {i}"


@pytest.fixture(scope="module")
def ref(reference_python, nodes) -> Any:
    return nodes(reference_python, "codec")


@pytest.fixture(scope="module")
def reference_files(ref, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("ref-encoded")
    return ref.ask({"op": "encode", "dtypes": DTYPES, "seed": SEED, "dir": str(out)})["files"]


@pytest.fixture(scope="module")
def reference_dtypes(ref) -> list[str]:
    return ref.ask({"op": "allow_list"})["dtypes"]


def test_kvferrys_allow_list_holds_the_references(reference_files, reference_dtypes) -> None:
    assert sorted(reference_files) == DTYPES  # the reference encodes every one of kvferry's
    assert set(reference_dtypes) <= set(DTYPES), sorted(set(reference_dtypes) - set(DTYPES))


@pytest.mark.parametrize("name", DTYPES)
def test_reference_bytes_decode_in_kvferry(reference_files, name) -> None:
    raw = open(reference_files[name], "rb").read()
    for decoded in (KVCacheTransferData.from_bytes(raw), decode_payload(raw).to_reference_dict()):
        check_layers(decoded, name)
        assert decoded["request_id"] == f"req-{name}" and decoded["block_ids"] == [DTYPES.index(name), 7]
        assert decoded["metadata"] == {"dtype": name}
    i = DTYPES.index(name)
    ours = KVCacheTransferData(f"req-{name}", source(name), [i, 7], {"dtype": name}).to_bytes()
    assert ours == raw  # compat writes the reference's bytes, byte for byte


@pytest.fixture(scope="module")
def kvferry_decoded_by_reference(ref, tmp_path_factory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("kvf-encoded")
    files: dict[str, dict[str, str]] = {}
    for i, name in enumerate(DTYPES):
        blocks = source(name)
        variants = {
            "compat": KVCacheTransferData(f"req-{name}", blocks, [i, 7], {"dtype": name}).to_bytes(),
            # both checksum algorithms: the reference ignores "ck" and "c" whichever it names
            "native": encode_bytes(
                f"req-{name}",
                blocks["key_cache"],
                blocks["value_cache"],
                [i, 7],
                {"dtype": name},
                checksums=("crc32", "crc32c")[i % 2],
            ),
        }
        for variant, data in variants.items():
            path = out / f"{variant}-{name}.bin"
            path.write_bytes(data)
            files.setdefault(name, {})[variant] = str(path)
    answer = ref.ask({"op": "decode", "files": [p for v in files.values() for p in v.values()]})["decoded"]
    return {name: {variant: answer[path] for variant, path in v.items()} for name, v in files.items()}


@pytest.mark.parametrize("variant", ["compat", "native"])
@pytest.mark.parametrize("name", DTYPES)
def test_kvferry_bytes_decode_in_the_reference(kvferry_decoded_by_reference, reference_dtypes, name, variant) -> None:
    answer = kvferry_decoded_by_reference[name][variant]
    if name not in reference_dtypes:  # kvferry carries it; the reference refuses it, by its phrase
        assert answer == {"error": f"Unsupported dtype in KV payload: {name}"}
        return
    decoded = torch.load(answer["saved"])
    check_layers(decoded, name)
    assert decoded["request_id"] == f"req-{name}" and decoded["metadata"]["dtype"] == name


def test_a_changed_byte_is_seen(reference_files) -> None:
    """The control: the comparison above would notice one flipped data byte."""
    raw = bytearray(open(reference_files["float32"], "rb").read())
    raw[-1] ^= 0xFF
    with pytest.raises(AssertionError):
        check_layers(KVCacheTransferData.from_bytes(bytes(raw)), "float32")


@pytest.fixture(scope="module")
def reference_faults(ref) -> dict[str, Any]:
    return ref.ask({"op": "faults", "payloads": {k: v.hex() for k, v in phrases_module.FAULTS.items()}})["raised"]


@pytest.mark.parametrize("name", sorted(phrases_module.FAULTS))
def test_the_reference_says_the_phrase_too(reference_faults, name) -> None:
    raised = reference_faults[name]
    assert raised is not None, f"the reference accepted the {name} fault"
    kind, is_value_error, message = raised
    assert is_value_error, f"the reference raised {kind}"
    assert re.search(phrases_module.as_pattern(REFERENCE_PHRASES[name]), message), message
    with pytest.raises(ValueError) as ours:
        KVCacheTransferData.from_bytes(phrases_module.FAULTS[name])
    assert re.search(phrases_module.as_pattern(REFERENCE_PHRASES[name]), str(ours.value))
