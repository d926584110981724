"""FP8 KV caches between real vLLM CPU instances (``kv_cache_dtype="fp8"`` on both sides).

vLLM CPU allocates an FP8 cache as ``uint8`` and writes it with its CPU kernel (``vec`` on a
CPU with AVX-512 and no AMX, ``amx`` with AMX and block size 32); the connector moves the
pages as their bytes, with every layer's ``k_scale``/``v_scale`` in each payload, and the
decode compares them with its own before it writes (docs/vllm.md, "FP8 caches"). The decode's
pages of the loaded blocks equal the prefill's byte for byte, its tokens equal the decode
instance's own for the prompt (a single FP8 instance), and the control hands it one prompt's
KV for another prompt of the same length, which must change its tokens.

vLLM CPU refuses an FP8 cache without AVX-512 or AMX ("FP8 KV cache on CPU requires x86 with
AVX-512 or AMX."): on such a CPU (an AVX2-only machine) the test skips, naming the feature.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import (
    Instance,
    assert_loaded_without_failures,
    assert_other_kv_changes_tokens,
    free_base_port,
    make_model,
    prompts,
    start_together,
    vllm_python,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

BS = 32
LENGTHS = [45, 130]
TOKENS = 12


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    flags = _cpu_flags()
    if not flags & {"avx512f", "amx_tile"}:
        pytest.skip("vLLM CPU's FP8 KV cache needs AVX-512 (avx512f) or AMX (amx_tile); this CPU has neither")
    py = vllm_python()
    root = tmp_path_factory.mktemp("vllm_fp8")
    return py, root, make_model(py, root / "model", 1)


def test_fp8_pages_and_tokens_equal_a_single_fp8_instance(model: Any) -> None:
    py, root, path = model
    base = {"model": str(path), "extra": {"base_port": free_base_port(), "load_timeout_s": 20}, "block_size": BS}
    fp8 = {**base, "kv_cache_dtype": "fp8"}
    d, p = start_together(
        lambda: Instance(py, {**fp8, "kv_role": "kv_consumer"}, cpu="0", log=root / "decode.log"),
        lambda: Instance(py, {**fp8, "kv_role": "kv_producer"}, cpu="1", log=root / "prefill.log"),
    )
    print("startup:", {"decode_s": round(d.startup_s, 1), "prefill_s": round(p.startup_s, 1)})
    try:
        ps = prompts(LENGTHS, seed=51)
        reference = [r["tokens"] for r in d.generate(ps, max_tokens=TOKENS)]  # the decode instance alone
        before = d.metrics()
        got = []
        for prompt in ps:
            [par] = [r["kv_transfer_params"] for r in p.generate([prompt], [{"do_remote_decode": True}], max_tokens=1)]
            full = (len(prompt) - 1) // BS  # whole pages: the decode computes the last prompt token itself
            p.send({"op": "pages", "blocks": full, "transfer_id": par["transfer_id"]})
            [theirs] = p.reply(120)["ranks"]
            [out] = d.generate([prompt], [par], max_tokens=TOKENS)
            got.append(out["tokens"])
            d.send({"op": "pages", "blocks": full})
            [mine] = d.reply(120)["ranks"]
            assert mine["dtype"] == theirs["dtype"] == "uint8"  # vLLM's FP8 cache: one byte per element
            assert mine["hashes"] == theirs["hashes"], f"prompt of {len(prompt)} tokens: FP8 pages differ"
        assert got == reference
        assert_loaded_without_failures(d, before, len(ps))
        # control: prompt B decoded over prompt A's KV (same length) follows A's KV, not B's prompt
        assert_other_kv_changes_tokens(p, d, ps[1], 52, TOKENS, before)
    finally:
        p.close()
        d.close()
